"""Write admission, probes and load pricing of the cost policy, as an operator relies on them: rules that
session 56's mutation check of the cost modules (hicache/cost_model.py, cost_policy.py, linear_cost.py,
reuse.py, scheduler/load.py) found no test watching. Cost lines are set by hand (nothing is timed), so
every decision asserted here is deterministic."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hicache.config import HiCacheConfig
from hicache.cost_model import CostModel
from hicache.linear_cost import LinearCost
from hicache.radix import Tier
from hicache_helpers import make_manager
from scheduler import load
from scheduler.request import RequestState

N = 100  # tokens a write or a hit carries in these tests


def _set_lines(cost: CostModel, *, recompute_us: float, h2d_us: float, s2h_us: float = 0.0,
               d2h_us: float = 0.0) -> None:
    """Cost lines with no fixed cost, each given in microseconds per token."""
    per_byte = 1e-6 / cost.bytes_per_token
    dirs = cost.directions
    for name, us in (("h2d", h2d_us), ("s2h", s2h_us), ("d2h", d2h_us)):
        dirs[name].fixed_s, dirs[name].slope = 0.0, us * per_byte
    dirs["recompute"].fixed_s, dirs["recompute"].slope = 0.0, recompute_us * 1e-6


def _cost_manager(**config):
    """A cost-policy manager with L3 whose exploration is over (no storage read or host transfer left to time)."""
    config.setdefault("storage_explore_reads", 0)
    config.setdefault("host_explore_transfers", 0)
    return make_manager(policy="cost", **config)


# -- write admission by price, under load --------------------------------------------------------------
def test_l3_writes_under_load_are_priced_beside_it_and_behind_the_reads_in_flight(monkeypatch):
    """A prefix whose L3 restore (3.1 us a token) is dearer than its recompute (1 us) is not written to L3
    on an idle engine; with 1 ms of GPU work queued (the manager's busy_s, which the engine sets) a later
    read of it would run beside that work, so the write is worth it. But an L3 read queues behind the
    storage reads in flight: with 1 ms of them, the queued work hides nothing for it and the write is
    refused again. An L2 write (no storage read) is not held back by the reads in flight."""
    mgr = _cost_manager(restore_explore_every=0)
    _set_lines(mgr.cost, recompute_us=1.0, h2d_us=0.1, s2h_us=3.0)
    assert not mgr.worth_writing("l3", N)  # alone: a read would cost more than the recompute it saves
    mgr.busy_s = 1e-3
    assert mgr.worth_writing("l3", N), "the GPU work queued was not credited to an L3 write"
    monkeypatch.setattr(mgr.runner, "reading_s", lambda: 1e-3)
    assert not mgr.worth_writing("l3", N), "an L3 write was credited work that the reads in flight already use"
    assert mgr.worth_writing("l2", N)


def test_a_write_that_only_breaks_even_is_not_made():
    """A write whose later restore would cost exactly what recomputing saves buys nothing for its traffic:
    worth_writing refuses it (a restore just cheaper is admitted), and so does the backup's own check,
    whose D2H costing exactly the recompute a read saves (minus its H2D) is refused."""
    cfg = HiCacheConfig(host_explore_transfers=0, storage_explore_reads=0, restore_explore_every=0)
    cost = CostModel(cfg, bytes_per_token=1)
    dirs = cost.directions
    for d in dirs.values():
        d.fixed_s = 0.0
    dirs["recompute"].slope, dirs["h2d"].slope, dirs["d2h"].slope = 0.5, 0.5, 0.25
    assert not cost.worth_writing("l2", N), "an L2 write whose restore only ties its recompute was admitted"
    dirs["h2d"].slope = 0.25
    assert cost.worth_writing("l2", N)
    # a read saves 0.5 - 0.25 a token; the D2H costs 0.25 a token: a tie
    assert not cost.backup_worth_its_cost(N), "a backup whose D2H only ties what a read saves was admitted"
    dirs["d2h"].slope = 0.125
    assert cost.backup_worth_its_cost(N)


# -- write probes ----------------------------------------------------------------------------------
def _refusing_l3(explore_every: int = 4) -> CostModel:
    cost = CostModel(HiCacheConfig(storage_explore_reads=0, host_explore_transfers=0,
                                   restore_explore_every=explore_every), bytes_per_token=256)
    _set_lines(cost, recompute_us=1.0, h2d_us=0.1, s2h_us=3.0)
    return cost


def test_a_write_probe_is_one_write_not_every_write_after_it():
    """After `restore_explore_every` refused L3 writes in a row one goes through as a probe, and the backup
    path lets it past its other checks because the cost model flags it (write_probe). The flag is that
    one ask's: the next refused ask is not a probe, or every backup after the first probe would skip
    the checks that keep useless writes off the host link."""
    cost = _refusing_l3(explore_every=4)
    asks = [cost.worth_writing("l3", N) for _ in range(4)]
    assert asks == [False, False, False, True] and cost.write_probe
    assert not cost.worth_writing("l3", N)
    assert not cost.write_probe, "a refused write after the probe still passes as a probe"


def test_a_timed_read_of_a_tier_restarts_the_count_of_its_refused_writes():
    """A refused tier is probed by a write only so that something gets read back and timed; a read of it
    that was timed anyway (another request's restore) does that job, so the next write probe comes
    `restore_explore_every` refusals after it, not sooner."""
    cost = _refusing_l3(explore_every=4)
    assert [cost.worth_writing("l3", N) for _ in range(3)] == [False] * 3
    s2h = cost.directions["s2h"]
    cost.observe_transfer("s2h", N * cost.bytes_per_token, s2h.predict(N * cost.bytes_per_token))
    assert [cost.worth_writing("l3", N) for _ in range(3)] == [False] * 3, (
        "a write probe came right after the tier was read and timed")
    assert cost.worth_writing("l3", N) and cost.write_probe


def test_l2_checks_spend_none_of_l3s_exploration_writes():
    """While no storage read has been timed, the first writes to L3 go ahead whatever its price, so that
    something is there to read back and time. Asking whether an L2 backup pays (which looks at L3's
    price) writes nothing to L3 and must not use those writes up: after 40 such looks the next real L3
    write still explores."""
    mgr = make_manager(policy="cost", host_explore_transfers=0)
    _set_lines(mgr.cost, recompute_us=1.0, h2d_us=0.1, s2h_us=3.0)
    assert mgr.cost.exploring_storage
    for _ in range(40):
        mgr.backup_pays_off(N)
    assert mgr.worth_writing("l3", N), "the L2 backup checks used up the L3 writes that explore the storage"


def test_without_l3_a_backup_is_refused_once_its_d2h_costs_more_than_it_saves():
    """With no L3 configured there is no storage speed to explore, so nothing lets a backup ahead of its
    price: a one-token extension whose D2H (1.5 ms fixed) costs more than the recompute one read of it
    saves is refused (the one-token-pages regression of session 17), though no storage read was ever
    timed."""
    mgr = make_manager(policy="cost", storage_pages=0, host_explore_transfers=0)
    _set_lines(mgr.cost, recompute_us=50.0, h2d_us=3.0, d2h_us=3.0)
    mgr.cost.directions["d2h"].fixed_s = 1.5e-3
    assert mgr.cost.learning and mgr.cost.exploring_storage  # (no storage read was ever timed)
    assert not mgr.backup_worth_its_cost(1), "a one-token backup dearer than its saving went ahead without any L3"
    assert mgr.backup_worth_its_cost(1000)  # a long extension pays


# -- write admission by reuse ------------------------------------------------------------------------
def test_a_forced_always_policy_writes_to_an_unproductive_l3():
    """--hicache-policy always writes every backup on down: an L3 whose pages are evicted unread is not
    throttled to probes, as it is under the cost policy."""
    mgr = make_manager(policy="always")
    mgr.reuse[Tier.L3].on_evicted(1000)
    assert not mgr.reuse[Tier.L3].productive
    assert all(mgr.l3_write_pays_off() for _ in range(32)), "the forced policy throttled L3 writes by reuse"


def test_l2_read_back_below_break_even_is_written_only_as_probes():
    """L2 backups pay only if enough of what is written is read back to save more recompute than the
    writes cost. Over a slow host link that break-even is ~31 % of what is evicted: an L2 that reads
    back 10 % (well above the fixed 1 % floor L3 keeps) is unproductive, and backups to it go through
    only as the reuse gate's probes (one in 16)."""
    mgr = _cost_manager(storage_pages=0, host_bandwidth_gib_s=1.0, recompute_us_per_token=1.0)
    fraction = mgr.cost.break_even_read_fraction()
    assert 0.2 < fraction < 1.0
    mgr.reuse[Tier.L2].on_evicted(1000)
    mgr.reuse[Tier.L2].on_read(100)
    decisions = [mgr.backup_pays_off(N) for _ in range(32)]
    assert decisions.count(True) == 2, f"{decisions.count(True)} of 32 backups to an L2 read below break-even"


# -- restore probes ----------------------------------------------------------------------------------
def test_l3_reads_restart_its_probe_count_even_while_it_is_charged_an_overhead():
    """An L3 charged an end-to-end overhead (its requests took 1 s beyond their price) loses every hit to
    recompute, and is probed once in `restore_explore_every` hits to see whether the overhead went
    away. A storage read timed meanwhile comes from an L3 restore, whose own outcome re-scores that
    charge: it restarts L3's count, so no extra probe is spent (unlike an H2D, which re-times L2's
    line but not L2's charge)."""
    cost = CostModel(HiCacheConfig(storage_explore_reads=0, host_explore_transfers=0, restore_explore_every=4,
                                   storage_bandwidth_gib_s=100.0), bytes_per_token=256)
    for _ in range(5):
        cost.observe_outcome("l3", 0.0, 1.0)
    picks = []
    for _ in range(12):
        picks.append(cost.decide(0, 0, N).tier)
        cost.observe_transfer("s2h", N * 256, cost.directions["s2h"].predict(N * 256))
    assert picks == ["l1"] * 12, f"an L3 probe came between timed L3 reads: {picks}"
    picks = [cost.decide(0, 0, N).tier for _ in range(4)]  # no read timed: the probe comes on time
    assert picks == ["l1", "l1", "l1", "l3"]


# -- the linear fit ----------------------------------------------------------------------------------
def test_sizes_one_unit_apart_fit_no_slope():
    """Two sizes one unit apart (tails of 1 and 2 tokens) carry no slope worth fitting: the line keeps its
    reference slope and learns a fixed cost, rather than a slope out of the noise between them."""
    cost = LinearCost(1e-3)
    cost.observe(1, 5e-3)
    cost.observe(2, 5e-3)
    assert cost.regime == "fixed_only" and cost.slope == pytest.approx(1e-3)


# -- the load besides a request ------------------------------------------------------------------------
def _req(rid, state, prefill_len, cached_len=0, max_tokens=8, output=(), prefetch_op=None):
    return SimpleNamespace(rid=rid, state=state, prefill_len=prefill_len, cached_len=cached_len,
                           params=SimpleNamespace(max_tokens=max_tokens), output=list(output), prefetch_op=prefetch_op)


def _engine(running, waiting, max_prefill_tokens=2048):
    cost = CostModel(HiCacheConfig(), bytes_per_token=256)
    cost.directions["recompute"].fixed_s, cost.directions["recompute"].slope = 5e-3, 1e-6
    cache = SimpleNamespace(config=SimpleNamespace(prefetch=True, policy="cost"), has_l2=True, cost=cost)
    return SimpleNamespace(cache=cache, running=running, waiting=waiting, aborting=set(),
                           config=SimpleNamespace(max_prefill_tokens=max_prefill_tokens))


def test_writes_are_admitted_by_the_least_load_besides_any_running_writer():
    """A backup is asked for by a running request, of its own pages: the load it is admitted by is the work
    besides the running request with the least of it. Here one prefills 1,000 tokens, one decodes and
    one waits with 3,000 tokens to prefill: besides the prefilling one there are the waiting one's 3,000
    tokens and the decode step (the least); a waiting request writes nothing and is no writer."""
    prefilling = _req("a", RequestState.PREFILL, 1000)
    decoding = _req("b", RequestState.DECODE, 10, cached_len=10, output=[1, 2])
    queued = _req("c", RequestState.WAITING, 3000)
    eng = _engine([prefilling, decoding], [queued])
    expected = eng.cache.cost.busy_s(3000, 2 + 1)  # 3,000 tokens in two forwards, plus the decode step
    assert load.write_busy_s(eng) == pytest.approx(expected)


def test_a_finished_prefetch_no_longer_shortens_its_requests_prefill():
    """A waiting request whose prefetch still reads its prefix will prefill only the tail after it; once
    that prefetch is done, its request is decided again and may recompute it all (a failed or declined
    read), so the whole prompt counts as load again."""
    op = SimpleNamespace(done=False, payload={"l3_end": 2000})
    queued = _req("c", RequestState.WAITING, 3000, prefetch_op=op)
    eng = _engine([], [queued])
    cost = eng.cache.cost
    assert load.busy_s(eng) == pytest.approx(cost.busy_s(1000, 1))
    op.done = True
    assert load.busy_s(eng) == pytest.approx(cost.busy_s(3000, 2)), "a finished prefetch still hid its prefix"

"""What /metrics exports against /hicache/status (a bug hunt): DESIGN.md section 9 lists policy
skips, L3 pages lost after a read, the per-direction latency split and L3 extents among the metrics;
an operator deciding whether L3 helps wants the cost model's current estimates too. Each is exported
with every label value there from the start (at 0), and says what status says after workloads with
L1 / L2 / L3 hits, a corrupt L3 page, and restores and writes the cost policy skipped.

The exposition is rendered in-process by the server's own `ServerMetrics` (what the /metrics route
returns) and parsed with prometheus_client's parser, read at the same idle moment as engine.status()."""
from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.metrics import DIRECTIONS, FAILURE_KINDS
from hicache.outcomes import OUTCOME_WINDOW
from hicache.radix import Tier
from hicache.storage_op import StorageError
from hicache_helpers import flip_l3_byte, until
from scheduler.prom import ServerMetrics
from scheduler.request import SamplingParams
from test_faults import OTHER, PROMPT, REUSABLE, finish, make_engine, only_in_l3, run_one

TIERS = ("l1", "l2", "l3")
SKIPS = ("restore", "write_l2", "write_l3")
PHASES = ("enqueue", "setup", "compute_wait", "queue_wait", "seen_wait", "service")
COST_LINES = ("d2h", "h2d", "h2s", "s2h", "recompute")


def exported(engine) -> tuple[dict, dict]:
    """(samples by (name, labels), type by family name) of one /metrics rendering."""
    samples, types = {}, {}
    for fam in text_string_to_metric_families(ServerMetrics(engine).render().decode()):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def value(samples: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"/metrics has no {name}{labels or ''}"
    return samples[key]


def assert_agrees_with_status(engine) -> dict:
    """Every cache counter, direction split and cost estimate /metrics exports is what status says."""
    samples, types = exported(engine)
    st = engine.status()
    m, cost = st["metrics"], st["cost_model"]["directions"]
    for kind in SKIPS:
        assert value(samples, "hicache_policy_skips_total", kind=kind) == m["policy_skips"][kind], kind
    assert value(samples, "hicache_storage_missing_pages_total") == m["storage_missing_pages"]
    assert value(samples, "hicache_restore_seconds_total") == pytest.approx(m["restore_s"], rel=1e-12)
    assert value(samples, "hicache_restore_overlapped_seconds_total") == pytest.approx(m["restore_overlapped_s"])
    for kind in FAILURE_KINDS:
        assert value(samples, "hicache_operation_failures_total", kind=kind) == m["failures"].get(kind, 0), kind
    for d in DIRECTIONS:
        s = m["directions"][d]
        assert value(samples, "hicache_transfer_bytes_total", direction=d) == s["bytes"], d
        assert value(samples, "hicache_transfers_total", direction=d) == s["count"], d
        assert value(samples, "hicache_transfer_seconds_total", direction=d) == pytest.approx(
            s["recurring_s"], rel=1e-12), d
        assert value(samples, "hicache_transfer_end_to_end_seconds_total", direction=d) == pytest.approx(
            s["end_to_end_s"], rel=1e-12), d
        for phase in PHASES:
            assert value(samples, "hicache_transfer_phase_seconds_total", direction=d, phase=phase) == pytest.approx(
                s[f"{phase}_s"], rel=1e-12), (d, phase)
    for d in ("h2s", "s2h"):
        assert value(samples, "hicache_storage_extents_total", direction=d) == m["directions"][d]["extents"], d
    for line in COST_LINES:
        assert value(samples, "hicache_cost_model_fixed_seconds", line=line) == pytest.approx(
            cost[line]["fixed_s"], rel=1e-12), line
        assert value(samples, "hicache_cost_model_samples", line=line) == cost[line]["samples"], line
    for d in DIRECTIONS:
        want = cost[d]["gib_s"]
        got = value(samples, "hicache_cost_model_gib_per_second", direction=d)
        assert got == (math.inf if want is None else pytest.approx(want, rel=1e-12)), d
    assert value(samples, "hicache_cost_model_recompute_seconds_per_token") == pytest.approx(
        cost["recompute"]["us_per_token"] * 1e-6, rel=1e-12)
    # counters are counters, named with _total; the new gauges are gauges
    for fam in ("hicache_policy_skips", "hicache_storage_missing_pages", "hicache_restore_seconds",
                "hicache_transfer_phase_seconds", "hicache_transfer_end_to_end_seconds", "hicache_storage_extents"):
        assert types.get(fam) == "counter", (fam, types.get(fam))
    for fam in ("hicache_cost_model_gib_per_second", "hicache_cost_model_fixed_seconds",
                "hicache_cost_model_recompute_seconds_per_token", "hicache_cost_model_samples"):
        assert types.get(fam) == "gauge", (fam, types.get(fam))
    return m


@pytest.mark.asyncio
async def test_metrics_export_what_status_says_after_hits_of_every_tier_and_a_corrupt_l3_page():
    """Before the fix /metrics had no policy skips, no L3 pages lost after a read, no latency split
    (queue wait vs service) per direction, no L3 extents and no cost-model estimate (all in
    /hicache/status only), and failure kinds appeared only once one had happened."""
    eng = make_engine()
    await eng.start()
    fresh, _ = exported(eng)
    assert value(fresh, "hicache_policy_skips_total", kind="write_l3") == 0  # every series there from the start
    assert StorageError.KINDS <= set(FAILURE_KINDS)
    tokens = PROMPT[:REUSABLE]
    await run_one(eng)
    await eng.cache.drain()
    await run_one(eng)                                    # an L1 hit
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    await run_one(eng)                                    # an L2 hit
    await eng.cache.drain()
    only_in_l3(eng, tokens)
    await run_one(eng)                                    # an L3 hit
    await eng.cache.drain()
    only_in_l3(eng, tokens)
    slots = eng.cache.tree.match(tokens, include_storage=True, touch=False).pages[Tier.L3]
    flip_l3_byte(eng.cache, int(slots[-1]))               # the read fails its checksum: the page is dropped
    await run_one(eng)
    await eng.cache.drain()
    m = assert_agrees_with_status(eng)
    assert all(m["hit_tokens"][t] > 0 for t in TIERS), m["hit_tokens"]
    assert m["storage_missing_pages"] > 0 and m["failures"] == {"checksum": 1}, m
    assert m["directions"]["s2h"]["extents"] > 0 and m["directions"]["h2s"]["extents"] > 0
    after, _ = exported(eng)
    assert set(after) == set(fresh)  # no series appeared with the workload (a failure kind either)
    await finish(eng)


@pytest.mark.asyncio
async def test_every_l3_page_a_failed_read_drops_is_counted():
    """Regression: one corrupt page in the middle of a prefix's L3 node drops that node from the
    corrupt page on and the prefixes under it (5 of 7 pages here; the 2 valid pages before it stay:
    tests/test_l3_drop_hunt.py), but storage_missing_pages counted the 1 corrupt slot: L3
    lost pages that no counter accounted for (written - evicted - missing != resident)."""
    eng = make_engine()
    await eng.start()
    tokens = PROMPT[:REUSABLE]
    await run_one(eng)
    await eng.cache.drain()
    only_in_l3(eng, tokens)
    slots = eng.cache.tree.match(tokens, include_storage=True, touch=False).pages[Tier.L3]
    before = eng.status()["tiers"]["l3"]["resident_pages"]
    flip_l3_byte(eng.cache, int(slots[2]))
    await run_one(eng)                                    # the read fails, the request recomputes
    lost = before - eng.status()["tiers"]["l3"]["resident_pages"]
    await eng.cache.drain()                               # ... and its backup writes L3 again
    st = eng.status()
    m = st["metrics"]
    assert m["failures"] == {"checksum": 1} and lost > 1
    assert m["storage_missing_pages"] == lost, (m["storage_missing_pages"], lost)
    written = m["directions"]["h2s"]["bytes"] // st["storage"]["bytes_per_page"]
    assert st["tiers"]["l3"]["resident_pages"] == written - m["evictions_pages"]["l3"] - m["storage_missing_pages"]
    samples, _ = exported(eng)
    assert value(samples, "hicache_storage_missing_pages_total") == lost
    await finish(eng)


@pytest.mark.asyncio
async def test_a_declined_restore_counts_one_skip_however_long_its_request_waits():
    """Regression: a request waiting for L1 room is decided again on every loop turn, and each
    decision that declined its L2 hit counted a policy skip: one request's one recomputed hit was
    ~70 restore skips here (one per decode step of the request holding the memory)."""
    eng = make_engine(num_pages=24, policy="cost", restore_explore_every=0, host_explore_transfers=0)
    await eng.start()
    await run_one(eng)
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)  # the prefix only in L2
    cost = eng.cache.cost
    for _ in range(OUTCOME_WINDOW):  # L2's requests took 1 s beyond their price: its hits are recomputed
        cost.observe_outcome("l2", 0.0, 1.0)
        cost.observe_outcome("l1", 0.0, 0.0)
    # another request holds 21 of the 24 L1 pages for 70 decode steps: PROMPT (8 pages) waits for them
    hog = asyncio.ensure_future(eng.generate_async([OTHER], SamplingParams(max_tokens=70, ignore_eos=True)))
    await until(lambda: eng.running)
    out = (await eng.generate_async([PROMPT], SamplingParams(max_tokens=4)))[0]
    await hog
    assert out.cached_tokens["l2"] == 0 and eng.status()["engine"]["batches"] > 70
    m = assert_agrees_with_status(eng)
    assert m["policy_skips"]["restore"] == 1, m["policy_skips"]
    await finish(eng)


@pytest.mark.asyncio
async def test_metrics_export_the_cost_policys_skips_and_estimates():
    """The cost policy, with host and storage priors far slower than recompute and one probe in
    two hits: restores and writes to L2 and L3 are skipped; /metrics counts them as status does,
    and exports the estimates the policy decided with (learned d2h / h2d lines, the priors of
    the rest)."""
    eng = make_engine(policy="cost", host_bandwidth_gib_s=1e-6, host_explore_transfers=0, restore_explore_every=2,
                      storage_bandwidth_gib_s=1e-6, storage_explore_reads=0)
    await eng.start()
    fresh, _ = exported(eng)
    assert value(fresh, "hicache_cost_model_gib_per_second", direction="s2h") == pytest.approx(1e-6)
    for _ in range(6):
        for prompt in (PROMPT, OTHER):
            await run_one(eng, prompt)
            await eng.cache.drain()
        eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    m = assert_agrees_with_status(eng)
    assert all(m["policy_skips"][k] > 0 for k in SKIPS), m["policy_skips"]
    assert m["hit_tokens"]["l2"] > 0
    after, _ = exported(eng)
    assert set(after) == set(fresh)
    await finish(eng)


def test_metrics_without_the_hierarchy_keep_the_same_families():
    """An engine without hicache (no L2 / L3) still renders every cache family, at 0."""
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine

    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=32, page_size=4))
    samples, _ = exported(eng)
    for kind in SKIPS:
        assert value(samples, "hicache_policy_skips_total", kind=kind) == 0
    assert value(samples, "hicache_storage_missing_pages_total") == 0
    asyncio.run(eng.shutdown())

"""HiCache in the serving loop: outputs never change, forced tiers really hit, cost policy and write
admission behave, every tier's accounting stays whole."""
import random

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

VOCAB = 512


def workload(seed=0, num_prefixes=4, prefix_len=48, rounds=3):
    rng = random.Random(seed)
    bases = [[rng.randrange(VOCAB) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [bases[i % num_prefixes] + [rng.randrange(VOCAB)] for i in range(num_prefixes * rounds)]


def run_sequential(engine, prompts, max_tokens=3):
    """One request at a time, backups drained in between: a deterministic replay."""
    import uvloop

    async def go():
        await engine.start()
        outs = []
        for p in prompts:
            outs.extend(await engine.generate_async([p], SamplingParams(max_tokens=max_tokens)))
            await engine.cache.drain()
        await engine.stop_loop()
        return outs
    return uvloop.run(go())


def make(tier, policy, num_pages=28, **hc):
    # L1 holds ~2 of the 4 prefixes (13 pages each); for l3, L2 holds ~1 so prefixes live in L3
    base = EngineConfig(model="tiny", num_pages=num_pages, page_size=4)
    if tier == "none":
        return Engine(base)
    host_ratio = 2.0 if tier == "l2" else 0.5
    storage_ratio = 0.0 if tier == "l2" else 8.0
    return Engine(base.with_hicache(enable=True, host_ratio=host_ratio, storage_ratio=storage_ratio,
                                    policy=policy, **hc))


def assert_whole(engine):
    engine.check_integrity()
    for tier, alloc in engine.cache.tree.allocators.items():
        assert alloc.num_private() == 0, f"{tier.name} has private pages left"


@pytest.fixture(scope="module")
def recompute_outputs():
    prompts = workload()
    eng = Engine(EngineConfig(model="tiny", num_pages=1024, page_size=4, enable_prefix_cache=False))
    return prompts, [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=3))]


@pytest.mark.parametrize("tier,policy", [("none", "always"), ("l2", "always"), ("l2", "cost"),
                                         ("l3", "always"), ("l3", "cost")])
def test_outputs_identical_and_forced_tier_hits(tier, policy, recompute_outputs):
    prompts, ref = recompute_outputs
    eng = make(tier, policy)
    out = run_sequential(eng, prompts)
    assert [r.output_ids for r in out] == ref
    hits = eng.metrics()["hit_tokens"]
    if tier == "l2":
        assert hits["l2"] > 0
    if tier == "l3" and policy == "always":
        assert hits["l3"] > 0
    assert_whole(eng)


def test_cost_policy_skips_slow_storage(recompute_outputs):
    """Storage far slower than recompute: the cost policy neither restores from L3 nor writes it."""
    prompts, ref = recompute_outputs
    eng = make("l3", "cost", storage_bandwidth_gib_s=1e-6, recompute_us_per_token=1.0, storage_explore_reads=0)
    out = run_sequential(eng, prompts)
    assert [r.output_ids for r in out] == ref
    m = eng.metrics()
    assert m["hit_tokens"]["l3"] == 0
    assert m["policy_skips"]["write_l3"] > 0
    assert m["directions"]["h2s"]["bytes"] == 0
    assert_whole(eng)


def test_storage_exploration_writes_even_backups_not_worth_their_cost(recompute_outputs, monkeypatch):
    """Regression (session 17's CI): with recompute this cheap a backup can cost more than the
    recompute it saves, and skipping it (CostModel.backup_worth_its_cost) left L3, written through
    L2, with nothing to read back, so the storage speed was never timed. While storage is explored
    backups are admitted (here every backup is called not worth its cost)."""
    from hicache.cost_model import CostModel

    monkeypatch.setattr(CostModel, "backup_worth_its_cost", lambda self, new_tokens: False)
    prompts, ref = recompute_outputs
    eng = make("l3", "cost", storage_bandwidth_gib_s=1e-6, recompute_us_per_token=1.0, storage_explore_reads=1)
    fresh = workload(seed=1, num_prefixes=1, rounds=1)  # a new prefix last: its backup comes after the exploration
    out = run_sequential(eng, prompts + fresh)
    assert [r.output_ids for r in out[:len(prompts)]] == ref
    assert eng.cache.cost.directions["s2h"].num_samples >= 1
    assert not eng.cache.cost.exploring_storage
    # once explored, the rule holds again (regression, session 18: asserted over the workload alone,
    # this depended on whether any hit after the exploration was recomputed rather than restored)
    assert eng.metrics()["policy_skips"]["write_l2"] > 0
    assert_whole(eng)


def test_cost_policy_explores_storage_then_uses_it(recompute_outputs):
    """The same hopeless storage prior as above, with one exploration read: L3 is written and read
    back once, and the measured read speed (the page cache) replaces the prior's 1e-6 GiB/s; later
    decisions follow the learned costs."""
    prompts, ref = recompute_outputs
    eng = make("l3", "cost", storage_bandwidth_gib_s=1e-6, recompute_us_per_token=1.0, storage_explore_reads=1)
    out = run_sequential(eng, prompts)
    assert [r.output_ids for r in out] == ref
    m = eng.metrics()
    s2h = eng.cache.cost.directions["s2h"]
    assert s2h.num_samples >= 1 and s2h.slope < s2h.prior_slope / 1000
    assert m["hit_tokens"]["l3"] > 0 and m["directions"]["h2s"]["bytes"] > 0
    assert not eng.cache.cost.exploring_storage
    assert_whole(eng)


def test_cost_policy_explores_the_host_link_then_uses_it(recompute_outputs):
    """Regression (session 19, the 4B stress workload on the H200): a pessimistic host-link prior
    made every backup look dearer than the recompute it saves, so nothing was backed up, nothing
    restored, and the prior was never corrected (1.00 x hicache off). Until a transfer each way is
    timed (host_explore_transfers) the cost policy backs up and restores L2 hits; then the measured
    link decides. With exploration off the prior alone decides, as it did."""
    prompts, ref = recompute_outputs
    eng = make("l2", "cost", host_bandwidth_gib_s=1e-6)
    assert [r.output_ids for r in run_sequential(eng, prompts)] == ref
    cost, m = eng.cache.cost, eng.metrics()
    assert not cost.exploring_host
    for direction in ("d2h", "h2d"):
        d = cost.directions[direction]
        assert d.num_samples >= 1 and d.slope < d.prior_slope / 1000
    assert m["hit_tokens"]["l2"] > 0 and m["directions"]["d2h"]["bytes"] > 0
    assert_whole(eng)
    eng = make("l2", "cost", host_bandwidth_gib_s=1e-6, host_explore_transfers=0)
    assert [r.output_ids for r in run_sequential(eng, prompts)] == ref
    m = eng.metrics()
    assert m["hit_tokens"]["l2"] == 0 and m["directions"]["d2h"]["bytes"] == 0
    assert_whole(eng)


def test_a_workload_without_reuse_stops_backing_up_though_the_host_link_stays_unexplored():
    """H2D is only timed by a restore, so with no prefix ever reused the host link stays unexplored
    (`exploring_host`), and exploration admits every backup its cost check would refuse. The reuse
    gate (`backup_pays_off`: is L2 read back?) still stops them once what was written gets evicted
    unread: exploration costs a few backups, not every one (a note open since session 19)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(49)] for _ in range(60)]  # nothing shared
    eng = make("l2", "cost")
    run_sequential(eng, prompts, max_tokens=1)
    m = eng.metrics()
    assert eng.cache.cost.exploring_host and m["hit_tokens"]["l2"] == 0
    assert eng.cache.metrics.backups_started < len(prompts) // 3
    assert m["policy_skips"]["write_l2"] > len(prompts) // 2
    assert_whole(eng)


def test_never_policy_behaves_like_no_hierarchy(recompute_outputs):
    prompts, ref = recompute_outputs
    eng = make("l3", "never")
    out = run_sequential(eng, prompts)
    assert [r.output_ids for r in out] == ref
    m = eng.metrics()
    assert m["hit_tokens"]["l2"] == m["hit_tokens"]["l3"] == 0
    assert m["directions"]["d2h"]["bytes"] == 0
    assert_whole(eng)


@pytest.mark.parametrize("write_policy", ["write_through_selective", "write_back"])
def test_write_policies(write_policy, recompute_outputs):
    prompts, ref = recompute_outputs
    # selective backs up a prefix hit twice in L1, so L1 must hold the working set there
    eng = make("l2", "always", num_pages=80 if write_policy == "write_through_selective" else 28,
               write_policy=write_policy)
    out = run_sequential(eng, prompts)
    assert [r.output_ids for r in out] == ref
    assert eng.metrics()["directions"]["d2h"]["bytes"] > 0  # something was backed up
    assert_whole(eng)


def test_blocking_restores(recompute_outputs):
    prompts, ref = recompute_outputs
    eng = make("l3", "always", prefetch=False)
    out = eng.generate(prompts, SamplingParams(max_tokens=3))
    assert [r.output_ids for r in out] == ref
    assert_whole(eng)


def test_concurrent_requests_with_hierarchy(recompute_outputs):
    prompts, ref = recompute_outputs
    eng = make("l3", "always")
    out = eng.generate(prompts, SamplingParams(max_tokens=3))
    assert [r.output_ids for r in out] == ref
    assert_whole(eng)


def test_status_reports_every_tier():
    eng = make("l3", "cost")
    eng.generate(workload()[:4], SamplingParams(max_tokens=2))
    st = eng.status()
    for tier in ("l1", "l2", "l3"):
        t = st["tiers"][tier]
        assert t["capacity_pages"] == t["free_pages"] + t["resident_pages"] + t["private_pages"]
    assert set(st["metrics"]["directions"]) == {"d2h", "h2d", "h2s", "s2h"}
    assert "directions" in st["cost_model"]
    assert st["pending"]["restores"] == 0


def test_jit_compile_stalls_are_not_learned(recompute_outputs, monkeypatch):
    """A transfer whose enqueue compiled a kernel is not a cost sample: one such stall once made the
    cost policy skip every later L2 restore (the model never re-measured). Regression for that."""
    import hicache.operations as operations

    prompts, ref = recompute_outputs
    eng = make("l2", "always")
    run_sequential(eng, prompts)
    assert eng.cache.cost.directions["h2d"].num_samples > 0  # enqueues here take microseconds
    monkeypatch.setattr(operations, "JIT_ENQUEUE_NS", 0)  # every enqueue now counts as a compile ...
    # ... of an asynchronous transfer (the CUDA path; on the CPU a long enqueue is the copy itself)
    monkeypatch.setattr(operations, "learnable", lambda tr: tr.enqueue_ns < operations.JIT_ENQUEUE_NS)
    eng = make("l2", "always")
    out = run_sequential(eng, prompts)
    assert [r.output_ids for r in out] == ref
    assert eng.metrics()["hit_tokens"]["l2"] > 0
    assert eng.cache.cost.directions["h2d"].num_samples == 0
    assert eng.cache.cost.directions["d2h"].num_samples == 0
    assert_whole(eng)

"""Write admission by observed reuse (hicache/reuse.py): a tier whose pages are evicted before anyone
reads them stops being written (but for probes), so write-through cannot make the engine slower."""
import pytest
from test_hicache_engine import run_sequential, workload

from hicache.radix import Tier
from hicache.reuse import TierReuse
from scheduler.config import EngineConfig
from scheduler.engine import Engine


def test_tier_reuse_counts_and_probes():
    r = TierReuse(min_evicted_pages=8, window_pages=32, probe_every=4)
    assert r.productive and r.admit()
    r.on_evicted(7)
    assert r.productive  # too little evidence yet
    r.on_evicted(1)
    assert not r.productive
    assert [r.admit() for _ in range(8)] == [False, False, False, True] * 2  # every 4th is a probe
    r.on_read(1)
    assert r.productive and r.admit()
    r.on_evicted(40)  # past the window: both counts halve
    assert r.evicted_pages == pytest.approx(24) and r.read_pages == pytest.approx(0.5)
    assert r.productive  # 0.5 >= 1% of 24
    with pytest.raises(ValueError):
        TierReuse(min_evicted_pages=0)


def _engine(policy):
    # L1 holds about two of the six prefixes and L2 is the size of L1: nothing survives in L2
    # until its prefix comes round again
    return Engine(EngineConfig(model="tiny", num_pages=28, page_size=4).with_hicache(
        enable=True, policy=policy, host_ratio=1.0, storage_ratio=0.0))


def test_unproductive_l2_is_written_less():
    prompts = workload(seed=4, num_prefixes=6, rounds=6)
    ref = [r.output_ids for r in run_sequential(Engine(EngineConfig(model="tiny", num_pages=28, page_size=4)),
                                                prompts)]
    always, cost = _engine("always"), _engine("cost")
    assert [r.output_ids for r in run_sequential(always, prompts)] == ref
    assert [r.output_ids for r in run_sequential(cost, prompts)] == ref
    a, c = always.metrics(), cost.metrics()
    assert a["hit_tokens"]["l2"] == 0  # the premise: writing everything, nothing survives in L2
    assert c["policy_skips"]["write_l2"] > 0  # the cost policy stopped writing once L2 evicted unread pages
    assert c["directions"]["d2h"]["bytes"] < a["directions"]["d2h"]["bytes"]
    cost.check_integrity()


def test_productive_l2_keeps_being_written():
    prompts = workload(seed=5, num_prefixes=4, rounds=4)
    eng = Engine(EngineConfig(model="tiny", num_pages=28, page_size=4).with_hicache(
        enable=True, policy="cost", host_ratio=4.0, recompute_us_per_token=1e4))
    run_sequential(eng, prompts)
    m = eng.metrics()
    assert m["hit_tokens"]["l2"] > 0 and m["policy_skips"]["write_l2"] == 0


def test_backup_admission_follows_reuse():
    """The gates themselves: L2 unproductive and L3 unproductive -> only probes; an L3 that is read
    back keeps L1 -> L2 backups going (they feed it) even when L2 itself is not read."""
    eng = Engine(EngineConfig(model="tiny", num_pages=28, page_size=4).with_hicache(
        enable=True, policy="cost", host_ratio=1.0, storage_ratio=4.0, storage_bandwidth_gib_s=1e3,
        recompute_us_per_token=1e3))
    cache = eng.cache
    assert cache.backup_pays_off(64) and cache.l3_write_pays_off()
    for tier in (Tier.L2, Tier.L3):
        cache.reuse[tier].on_evicted(1000)
    decisions = [cache.backup_pays_off(64) for _ in range(32)]
    assert decisions.count(True) == 2  # probes only (every 16th)
    assert [cache.l3_write_pays_off() for _ in range(16)].count(True) == 1
    cache.reuse[Tier.L3].on_read(100)
    assert all(cache.backup_pays_off(64) for _ in range(8))  # feeding a productive L3
    forced = Engine(EngineConfig(model="tiny", num_pages=28, page_size=4).with_hicache(
        enable=True, policy="always", host_ratio=1.0))
    forced.cache.reuse[Tier.L2].on_evicted(1000)
    assert forced.cache.backup_pays_off(64)  # forced policies decide alone


def test_flush_is_not_evidence_against_writing():
    """Regression (session 3 GPU stress run 2): the benchmark emptied every tier after its warm-up, the
    evictions counted as pages written and never read, and the cost policy declined 22 of the
    L2 tier's 30 backups, so requests recomputed prefixes a large L2 would have held."""
    eng = Engine(EngineConfig(model="tiny", num_pages=28, page_size=4).with_hicache(
        enable=True, policy="cost", host_ratio=4.0))
    run_sequential(eng, workload(seed=6, num_prefixes=4, rounds=1))
    freed = eng.cache.flush(Tier.L2)
    assert freed > 0 and eng.metrics()["evictions_pages"]["l2"] == freed
    assert eng.cache.reuse[Tier.L2].evicted_pages == 0
    assert all(eng.cache.backup_pays_off(64) for _ in range(16))
    eng.cache.check_integrity()


def test_break_even_read_fraction_weighs_writes_against_savings():
    from hicache.config import HiCacheConfig
    from hicache.cost_model import CostModel

    per_token = 147456  # 8B shape, bf16
    cm = CostModel(HiCacheConfig(host_bandwidth_gib_s=12.0, recompute_us_per_token=50.0), per_token)
    write_s = per_token / (12.0 * (1 << 30))
    assert cm.break_even_read_fraction() == pytest.approx(write_s / (50e-6 - write_s))
    slow = CostModel(HiCacheConfig(host_bandwidth_gib_s=0.5, recompute_us_per_token=50.0), per_token)
    assert slow.break_even_read_fraction() == 1.0  # a restore saves nothing: only full reuse pays
    fast = CostModel(HiCacheConfig(host_bandwidth_gib_s=1e6, recompute_us_per_token=50.0), per_token)
    assert fast.break_even_read_fraction() == 0.01  # the floor


def test_one_token_extensions_are_not_backed_up_once_a_backup_is_known_to_cost_more():
    """Regression (session 17, one-token pages on the H200): each request of a prefix plus a unique
    token backed up that one token (72 extra D2Hs on the stress workload, ~0.5 ms of loop time
    each). With the D2H's fixed cost known (1.5 ms) only the first request's whole prompt is backed
    up; the later ones' one new token each is skipped and counted, and outputs are unchanged."""
    import random

    rng = random.Random(7)
    prefix = [rng.randrange(512) for _ in range(64)]
    prompts = [prefix + [rng.randrange(512)] for _ in range(4)]
    ref = [r.output_ids for r in run_sequential(Engine(EngineConfig(model="tiny", num_pages=512, page_size=1)),
                                                prompts, max_tokens=1)]
    eng = Engine(EngineConfig(model="tiny", num_pages=512, page_size=1).with_hicache(
        enable=True, policy="cost", host_ratio=4.0, recompute_us_per_token=50.0))
    cost = eng.cache.cost
    for _ in range(8):
        cost.directions["d2h"].observe(4096, 1.5e-3)
    cost.learning = False  # keep that fixed cost: CPU copies would teach a far smaller one
    assert [r.output_ids for r in run_sequential(eng, prompts, max_tokens=1)] == ref
    m = eng.metrics()
    assert m["backups_done"] == 1 and m["policy_skips"]["write_l2"] == 3
    eng.check_integrity()

"""The online cost model as a running engine (or manager) experiences it: slowness injected into the
real copies and reads (wrapped transfers, hicache/faults.py), decisions and counters asserted, never
wall time."""
from __future__ import annotations

import asyncio
import time

from hicache.radix import Tier
from tests.hicache_helpers import assert_whole, make_manager, toks, write_prefix

PAGE_COPY_S = 0.002  # a slowed host link: 2 ms of copy per page (the CPU copies inside the enqueue)


def _slow_h2d(mgr, slow: dict) -> None:
    """Every whole H2D copy of `mgr` takes PAGE_COPY_S a page more while slow["on"]."""
    whole = mgr.transfer._whole

    def copy(direction, idx, *args, **kwargs):
        if direction == "h2d" and slow["on"]:
            time.sleep(PAGE_COPY_S * len(idx))
        return whole(direction, idx, *args, **kwargs)

    mgr.transfer._whole = copy


def test_a_refused_l2_write_is_probed_every_restore_explore_every_backups():
    """The host link is timed slow (H2D dearer a token than recompute), so `worth_writing("l2")`
    refuses L2 writes and, every `restore_explore_every` refusals, lets one through as a probe: a
    tier never written is never read back, and its H2D never re-timed. Regression: the probe was
    then refused by `backup_worth_its_cost` (whose saving, recompute minus that same H2D, is <= 0
    whenever worth_writing refuses), whose own probe counted only those asks: one L2 write in
    explore_every**2 (1 in 1,024 by default) instead of one in explore_every."""
    every = 4
    mgr = make_manager(l1_pages=16, host_pages=64, storage_pages=0, policy="cost", recompute_us_per_token=10.0,
                       host_explore_transfers=1, restore_explore_every=every)
    slow = {"on": True}
    _slow_h2d(mgr, slow)
    cm = mgr.cost

    async def main() -> int:
        # prefixes of 1 and 4 pages backed up (while no H2D is timed, every backup is), then
        # restored over the slow link: the H2D line learns its slope (these restores are forced:
        # once the first is timed the policy would recompute them)
        prefixes = [toks((1000 * i, 1000 * i + 4 * num_pages)) for i, num_pages in enumerate((1, 4, 1, 4, 1, 4))]
        for i, tokens in enumerate(prefixes):
            write_prefix(mgr, tokens, seed=i)
            await mgr.drain()
            mgr.tree.evict(Tier.L1, mgr.l1.num_pages)
        for i, tokens in enumerate(prefixes):
            m = mgr.match(tokens)
            assert m.lengths[Tier.L2] == len(tokens), (i, m.lengths, mgr.metrics.policy_skips)
            await mgr.runner.wait_op(mgr.runner.start_restore(tokens, m, "l2", f"r{i}"))
            await mgr.drain()
            mgr.tree.evict(Tier.L1, mgr.l1.num_pages)
        assert not cm.exploring_host and not cm.worth_writing("l2", 16, probe=False), cm.state()
        slow["on"] = False
        started = mgr.metrics.backups_started
        for i in range(40):  # new prefixes: each asks for an L2 write
            write_prefix(mgr, toks((100_000 + 1000 * i, 100_000 + 1000 * i + 16)), seed=i)
            await mgr.drain()
        return mgr.metrics.backups_started - started

    probes = asyncio.run(main())
    assert probes >= 40 // every - 1, (
        f"{probes} L2 writes in 40 refused asks (one expected every {every}): {mgr.metrics.policy_skips}")
    assert_whole(mgr)


def test_an_l2_charged_an_overhead_that_went_away_is_probed_though_l3_restores_time_the_h2d():
    """Prefix P is an L2 hit every cycle, and an L3 hit (another prefix, read through L2) comes
    between any two of P's. The L2 path first costs 120 ms more than its price (host work no copy
    includes), so once MIN_OUTCOMES of P's restores were scored its hits are recomputed; then the
    overhead goes away. Only a probe of L2 (one in restore_explore_every L2 hits) can score it
    again. Regression: every L3 restore's H2D restarted L2's count (`observe_transfer`: "the tier
    was just timed"), which re-times L2's price but not its charge, so L2 was never probed and P
    was recomputed for good. (Storage stays explored, so every L3 hit is restored: how L3's own
    decisions fall on this CPU does not matter.)"""
    import random

    from hicache.operations import OpRunner
    from hicache.outcomes import MIN_OUTCOMES
    from scheduler.engine import Engine, EngineConfig
    from scheduler.request import SamplingParams

    every = 4
    eng = Engine(EngineConfig(model="tiny", num_pages=216, page_size=4).with_hicache(
        enable=True, host_ratio=1.0, storage_ratio=8.0, policy="cost", restore_explore_every=every,
        storage_explore_reads=10 ** 6))
    rng = random.Random(0)
    p = [rng.randrange(256) for _ in range(400)]
    others = [[rng.randrange(256) for _ in range(400)] for _ in range(6)]  # L2 holds P and one of them
    slow = {"on": True}
    start = OpRunner.start_restore

    def start_restore(self, tokens, match, tier, *args, **kwargs):
        if tier == "l2" and slow["on"]:
            time.sleep(0.12)  # (30 ms lost to a recompute slowed by a loaded machine: CI under xdist)
        return start(self, tokens, match, tier, *args, **kwargs)

    def source(result) -> str:
        return "l3" if result.cached_tokens["l3"] else "l2" if result.cached_tokens["l2"] else "l1"

    async def main() -> list[str]:
        await eng.start()

        async def ask(prompt) -> str:
            [result] = await eng.generate_async([prompt + [rng.randrange(256)]], SamplingParams(max_tokens=1))
            await eng.cache.drain()
            eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)  # the next request's prefix is not in L1
            return source(result)

        for prompt in others + [p]:  # cold: written to L2 and L3 (P last: L2 keeps it)
            await ask(prompt)
        seen = []
        for cycle in range(8 + 4 * every):
            if cycle == 8:
                assert eng.cache.cost.outcomes.state()["l2"]["samples"] >= MIN_OUTCOMES, seen
                assert seen[-1] == "l1", seen  # charged: recomputed
                slow["on"] = False
                seen.append("|")
            assert eng.cache.tree.match(p, touch=False).lengths[Tier.L2] == 400
            seen.append(await ask(p))
            assert await ask(others[cycle % len(others)]) == "l3"
        await eng.stop_loop()
        return seen

    import pytest
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(OpRunner, "start_restore", start_restore)
        seen = asyncio.run(main())
    after = seen[seen.index("|") + 1:]
    assert "l2" in after, f"P's L2 hits were never restored again: {' '.join(seen)}"
    eng.check_integrity()
    asyncio.run(eng.shutdown())

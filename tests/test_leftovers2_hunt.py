"""Leftovers of earlier hunts: a request that `add_request` refused with an error stays queued; an L3
write probe of the cost policy vetoed by the checks after it."""
from __future__ import annotations

import asyncio
import random

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

PROMPT = [5 + i for i in range(20)]


def test_add_request_that_raises_leaves_nothing_queued(monkeypatch):
    """`add_request` registers a request, then starts its prefetch; if that raises (it did with the
    Redis L3 outside a running loop, before session 30 deferred the hint refresh: see
    tests/test_leftovers3_hunt.py), the caller is told it failed, so the request must not stay
    queued (regression: it stayed in `requests` and `waiting`, and the next `generate` ran it, or
    an idle check waited on it)."""
    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4).with_hicache(enable=True, policy="always"))

    def fails(req):
        raise RuntimeError("the store cannot be asked now")

    with monkeypatch.context() as patch:
        patch.setattr(eng.admission, "maybe_prefetch", fails)
        with pytest.raises(RuntimeError, match="cannot be asked"):
            eng.add_request(PROMPT, SamplingParams(max_tokens=2), rid="lost")
    assert not eng.requests and not eng.waiting, (list(eng.requests), [r.rid for r in eng.waiting])
    try:
        [result] = eng.generate([PROMPT], SamplingParams(max_tokens=2))  # (runs on a loop of its own)
        assert result.error is None and eng.stats["finished"] == 1, (result, eng.stats)
        eng.check_integrity()
    finally:
        asyncio.run(eng.shutdown())


def engine_counting_l3_writes(**hicache) -> tuple[Engine, list]:
    """A cost-policy engine (64 L1 pages of 4 tokens, no storage exploration, `hicache` on top);
    `writes` gets an entry per L3 write. (Also tests/test_leftovers3_hunt.py.)"""
    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4).with_hicache(
        enable=True, policy="cost", storage_explore_reads=0, **hicache))
    writes: list = []
    write_pages = eng.cache.store.write_pages

    def counted(*args, **kwargs):
        writes.append(1)
        return write_pages(*args, **kwargs)

    eng.cache.store.write_pages = counted
    return eng, writes


async def l3_writes_over_new_prompts(eng: Engine, writes: list, prompts: int, seed: int, unproductive=()) -> int:
    """Start `eng`, serve 10 new 64-token prompts (L2 and L3 evict 64 pages nobody read: the tiers
    in `unproductive` are asserted so by then), then `prompts` more: the L3 writes those made."""
    rng = random.Random(seed)
    await eng.start()
    for i in range(10 + prompts):
        if i == 10:
            for tier in unproductive:
                assert not eng.cache.reuse[tier].productive, (tier, eng.cache.reuse[tier].state())
            written = len(writes)
        await eng.generate_async([[rng.randrange(256) for _ in range(64)]], SamplingParams(max_tokens=1))
        await eng.cache.drain()
    await eng.stop_loop()
    return len(writes) - written


def test_a_refused_l3_write_is_probed_every_restore_explore_every_backups():
    """The storage estimate is bad from the start (a pessimistic prior, nothing read back to
    correct it), so `worth_writing("l3")` refuses L3 writes and lets one in `restore_explore_every`
    through as a probe. L3 is small: each probe's write evicts the last one's pages unread, so after
    a few probes the reuse gate (`l3_write_pays_off`) calls L3 unproductive. Regression: that gate
    then refused the probe itself (nothing is read back from a tier restores skip, for the same
    estimate), and counted its own probes only on those asks: one L3 write in
    restore_explore_every * 16 asks, so a tier whose first estimate was wrong was hardly re-timed."""
    from hicache.radix import Tier

    every = 2  # (a storage read at 1e-6 GiB/s: every L3 write is refused but the probes)
    eng, writes = engine_counting_l3_writes(host_ratio=8.0, storage_ratio=16 / 512, restore_explore_every=every,
                                            storage_bandwidth_gib_s=1e-6)
    assert eng.cache.allocator(Tier.L3).num_pages == 16
    rng = random.Random(0)

    async def main() -> tuple[int, int]:
        await eng.start()
        asks = 0
        for i in range(10 + 12 * every):
            if i == 10:  # L3 evicted 64 pages nobody read: unproductive by now
                assert not eng.cache.reuse[Tier.L3].productive, eng.cache.reuse[Tier.L3].state()
                written, asks = len(writes), 0
            backups = eng.cache.metrics.backups_started
            await eng.generate_async([[rng.randrange(256) for _ in range(64)]], SamplingParams(max_tokens=1))
            await eng.cache.drain()
            asks += eng.cache.metrics.backups_started - backups  # (each L2 backup asks for an L3 write)
        await eng.stop_loop()
        return len(writes) - written, asks

    try:
        probes, asks = asyncio.run(main())
        assert asks >= 12 * every, asks
        assert probes >= asks // every - 1, (
            f"{probes} L3 writes in {asks} refused asks (one expected every {every}): "
            f"{eng.cache.metrics.policy_skips}, {eng.cache.reuse[Tier.L3].state()}")
        eng.check_integrity()
    finally:
        asyncio.run(eng.shutdown())


def test_an_l3_write_probe_is_asked_for_when_l2_refuses_the_backup():
    """As above, L3 writes are refused on a bad first estimate, but L3 is large (its reuse gate
    never objects) and L2 small: every prompt is new, so L2 evicts its backups unread and its reuse
    gate (`backup_pays_off`) refuses all but one L1 -> L2 backup in 16. An L3 write goes through L2:
    refused there, it was never asked for, so the L3 probe counted only the asks of the backups L2
    let through. Regression: one L3 write in restore_explore_every * 16 prompts."""
    from hicache.radix import Tier

    every = 2
    eng, writes = engine_counting_l3_writes(host_ratio=0.5, storage_ratio=16.0, restore_explore_every=every,
                                            storage_bandwidth_gib_s=1e-6)
    try:
        probes = asyncio.run(l3_writes_over_new_prompts(eng, writes, 12 * every, seed=1, unproductive=(Tier.L2,)))
        assert probes >= 12 - 1, (
            f"{probes} L3 writes in {12 * every} prompts (one expected every {every}): "
            f"{eng.cache.metrics.policy_skips}, {eng.cache.reuse[Tier.L2].state()}")
        eng.check_integrity()
    finally:
        asyncio.run(eng.shutdown())

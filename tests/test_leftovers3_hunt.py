"""Leftovers of earlier hunts: `add_request` outside a running loop with a shared (Redis) L3; the L3
reuse gate's probe behind an L2 whose reuse gate refuses most backups."""
from __future__ import annotations

import asyncio

from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from redis_server import needs_redis, redis_server, server  # noqa: F401
from test_leftovers2_hunt import engine_counting_l3_writes, l3_writes_over_new_prompts

PROMPT = [5 + i for i in range(20)]


def _redis_engine(url: str) -> Engine:
    return Engine(EngineConfig(model="tiny", num_pages=64, page_size=4).with_hicache(
        enable=True, policy="always", storage_backend="redis", storage_url=url, prefetch=False))


@needs_redis
def test_add_request_outside_a_running_loop_with_redis_is_accepted_and_refreshes_hints(server):
    """Other backends queue a request `add_request` is given outside a running loop (it runs once
    the loop does); with the Redis L3, whose queue-time hint refresh runs in a task, it raised
    asyncio's bare RuntimeError("no running event loop"). The refresh must still happen, once the
    loop runs: the prefix another instance wrote to Redis is restored from L3."""
    writer = _redis_engine(server.url())
    try:
        [ref] = writer.generate([PROMPT], SamplingParams(max_tokens=3))  # (writes PROMPT's pages to Redis)
        assert ref.error is None, ref
    finally:
        asyncio.run(writer.shutdown())
    eng = _redis_engine(server.url())  # a fresh tree: only Redis knows the prefix
    try:
        req = eng.add_request(PROMPT, SamplingParams(max_tokens=3), rid="early")

        async def main() -> None:
            await eng.start()
            while not (await req.queue.get()).finished:
                pass
            await eng.stop_loop()

        asyncio.run(main())
        result = req.result()
        assert result.error is None and result.output_ids == ref.output_ids, (result, ref)
        assert eng.metrics()["hit_tokens"]["l3"] == 16, eng.metrics()["hit_tokens"]  # its 4 full reusable pages
        assert eng.status()["storage"]["hint_queries"] == 1, eng.status()["storage"]
        assert not eng.metrics()["failures"], eng.metrics()["failures"]
        eng.check_integrity()
    finally:
        asyncio.run(eng.shutdown())


def test_the_l3_reuse_probe_is_counted_where_l2_refuses_the_backup():
    """L2 and L3 are both too small for a workload of new prompts: each evicts what it holds unread,
    so both reuse gates call their tier unproductive and let one write in `probe_every` through as
    a probe. L3's writes are worth their cost (a fast store), but an L3 write goes through L2, whose
    gate refuses 15 backups in 16. Regression: the L3 gate counted its probe only on the asks of
    the backups L2 let through, so an L3 write came once in 16 * 16 = 256 prompts, not once in 16:
    an L3 that would become productive was hardly re-tested."""
    eng, writes = engine_counting_l3_writes(host_ratio=0.5, storage_ratio=0.5)
    assert (eng.cache.allocator(Tier.L2).num_pages, eng.cache.allocator(Tier.L3).num_pages) == (32, 16)
    probe_every = eng.cache.reuse[Tier.L3].probe_every
    prompts = 4 * probe_every
    try:
        probes = asyncio.run(l3_writes_over_new_prompts(eng, writes, prompts, seed=1, unproductive=(Tier.L2, Tier.L3)))
        assert probes >= prompts // probe_every - 1, (
            f"{probes} L3 writes in {prompts} prompts (one expected every {probe_every}): "
            f"{eng.cache.metrics.policy_skips}, L2 {eng.cache.reuse[Tier.L2].state()}, "
            f"L3 {eng.cache.reuse[Tier.L3].state()}")
        assert eng.cache.metrics.backups_started < 10 + 2 * prompts // probe_every + 2  # (L2 still refuses the rest)
        eng.check_integrity()
    finally:
        asyncio.run(eng.shutdown())

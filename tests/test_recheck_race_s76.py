"""A backup's recheck of a shared L3's hints (RedisStore.recheck_hints) whose reply is older than a sibling's L3 write
of the same pages (session 76; the refresh's race was session 75's, test_hint_race_s75.py). Two prompts extend a
prefix the tree hints in Redis but Redis lost; both backups ask whether the prefix is still there. The sibling's
answer comes first: it drops the stale hints, writes the prefix again and publishes it. The first one's answer, sent
before that write, says "gone" and must not drop what the write just put back.

Tests start `redis-server` on a free loopback port (skipped without the binary)."""
from __future__ import annotations

import asyncio

import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, until, write_prefix
from redis_server import needs_redis, private_server, redis_server, server  # noqa: F401

_FIXTURES = (redis_server, server, private_server)
PREFIX = tuple(range(100, 116))  # 4 pages of 4 tokens
A, B = PREFIX + (1, 2, 3, 4), PREFIX + (5, 6, 7, 8)


async def hinted_but_lost(server):
    """A write-through manager on `server` whose tree hints PREFIX in Redis (L1 and L2 serve it too) that Redis lost;
    its hint queries' timeout long (a test holds a reply)."""
    mgr = make_manager(storage_backend="redis", storage_url=server.url(), model_id="m", write_policy="write_through")
    mgr.store.hint_timeout_s = 30.0
    write_prefix(mgr, PREFIX)
    await mgr.drain()
    assert mgr.store.counters["pages_written"] == 4 and mgr.match(PREFIX).lengths == [16, 16, 16]
    server.client().flushall()
    return mgr


def hold_first_reply(store):
    """The store's first hint query is answered by the server at once, its reply seen only once `gate` is set
    (`answered` set meanwhile); `calls`: each query's key count."""
    real_count, gate, answered = store.count_present, asyncio.Event(), asyncio.Event()
    calls: list[int] = []

    async def count_present(keys):
        calls.append(len(keys))
        found = await real_count(keys)
        if len(calls) == 1:
            answered.set()
            await gate.wait()
        return found
    store.count_present = count_present
    return gate, answered, calls


@needs_redis
@pytest.mark.asyncio
async def test_a_recheck_reply_older_than_a_siblings_write_drops_none_of_its_hints(server):
    mgr = await hinted_but_lost(server)
    store = mgr.store
    gate, answered, calls = hold_first_reply(store)  # (A's recheck's)
    write_prefix(mgr, A, start=16, seed=1)  # (write-through: A's backup starts, then B's)
    await asyncio.wait_for(answered.wait(), 10)  # A asked before B's write: none of the prefix
    write_prefix(mgr, B, start=16, seed=2)
    await until(lambda: mgr.pending_ops() == 1)  # B's recheck dropped the hints, B wrote the prefix again
    assert mgr.match(B).lengths[Tier.L3] == 20 and store.counters["pages_written"] == 4 + 5
    gate.set()
    await mgr.drain()
    assert calls == [4, 4]
    assert store.counters["stale_hints_dropped"] == 4  # (B's, of the pages Redis lost; none of B's fresh ones)
    assert mgr.match(B).lengths[Tier.L3] == 20 and mgr.match(A).lengths[Tier.L3] == 20
    assert store.counters["pages_written"] == 4 + 5 + 1  # A wrote only its own page
    assert not mgr.metrics.failures
    assert_whole(mgr)
    await mgr.close()

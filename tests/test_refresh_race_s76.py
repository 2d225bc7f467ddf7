"""A shared L3's hint refresh (RedisStore.refresh_hints) whose reply is older than a sibling backup's L3 write of the
same pages (session 76; the recheck's twin is test_recheck_race_s76.py, the refresh's own write session 75's). The
tree hints a prefix that Redis lost. A longer prompt's refresh asks which of its pages Redis holds; before its reply is
seen, a backup of another prompt over that prefix rechecks it, drops the stale hints, writes the prefix again and
publishes it. The refresh's reply, sent before that write, says "none": it must not drop what the write just put back
(it did: the prefix's hints and the sibling's page were dropped as stale, and a later request recomputed what Redis
held, its next backup writing it again).

Tests start `redis-server` on a free loopback port (skipped without the binary)."""
from __future__ import annotations

import asyncio

import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole, write_prefix
from redis_server import needs_redis, private_server, redis_server, server  # noqa: F401
from test_recheck_race_s76 import PREFIX, hinted_but_lost, hold_first_reply

_FIXTURES = (redis_server, server, private_server)
A, C = PREFIX + (1, 2, 3, 4), PREFIX + (9, 10, 11, 12)


@needs_redis
@pytest.mark.asyncio
async def test_a_refresh_reply_older_than_a_siblings_write_drops_none_of_its_hints(server):
    mgr = await hinted_but_lost(server)
    store = mgr.store
    gate, answered, calls = hold_first_reply(store)  # (C's refresh's)
    refresh = asyncio.ensure_future(store.refresh_hints(mgr, C))  # L1/L2 lack C's last page: it asks
    await asyncio.wait_for(answered.wait(), 10)  # none of C's pages yet
    write_prefix(mgr, A, start=16, seed=1)  # A's backup: its recheck drops the stale hints, it writes them again
    await mgr.drain()
    assert mgr.match(A).lengths[Tier.L3] == 20 and store.counters["pages_written"] == 4 + 5
    gate.set()
    await asyncio.wait_for(refresh, 10)
    assert calls == [5, 4]
    assert store.counters["stale_hints_dropped"] == 4  # (the recheck's, of the pages Redis lost)
    assert mgr.match(A).lengths[Tier.L3] == 20 and mgr.match(C).lengths[Tier.L3] == 16
    assert not mgr.metrics.failures
    assert_whole(mgr)
    await mgr.close()

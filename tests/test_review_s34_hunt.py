"""Session 34's review hunt: regression tests for bugs found in min_tokens (dba67e7), the cost model's
prefill chunk forwards (f7d6614) and the Redis limits' rechecks (cb0303d).

Redis tests start `redis-server` on a free loopback port of their own (skipped without the binary)."""
from __future__ import annotations

import asyncio

import pytest

from hicache import redis_limits
from hicache.radix import Tier
from hicache_helpers import capture_op_logs, make_manager, write_prefix
from redis_server import needs_redis, private_server  # noqa: F401

RECHECK_S = 0.01  # the injected recheck interval; each wait below is just past it
PAGE_TOKENS = 4096  # make_manager's geometry: 256 bytes a token, so a page's value is just over 1 MiB


@needs_redis
@pytest.mark.asyncio
async def test_a_backup_whose_write_lifts_the_refusal_checks_the_stale_hints_first(private_server, monkeypatch):
    """regression: `recheck_hints` skipped its existence check while writes were refused ("the write
    that follows tells"), but with rechecks (cb0303d) the write that follows may read the raised limit
    and go through: it wrote only the pages past the stale hints, and the prefix that Redis lost
    while writes were refused never reached it again."""
    monkeypatch.setattr(redis_limits, "LIMITS_RECHECK_S", RECHECK_S)
    sync = private_server.client()
    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=16, page_size=PAGE_TOKENS,
                       storage_backend="redis", storage_url=private_server.url())
    store, ps = mgr.store, PAGE_TOKENS
    assert store.value_bytes > redis_limits.MIN_BULK_LIMIT_BYTES
    tokens = tuple(range(3 * ps))
    write_prefix(mgr, tokens[:2 * ps])
    await mgr.drain()
    keys = store.page_keys(tokens, 0, 3 * ps)
    assert sync.exists(*keys[:2]) == 2  # the prefix is in Redis, and the tree says so
    sync.config_set("proto-max-bulk-len", 1 << 20)  # lowered at runtime: the next write is refused
    with capture_op_logs():
        write_prefix(mgr, tokens[:3 * ps], start=2 * ps)
        await mgr.drain()
    assert store.refusals.writes is not None and sync.exists(keys[2]) == 0
    sync.flushall()  # Redis loses the prefix while writes are refused: the tree's L3 hints are stale
    sync.config_set("proto-max-bulk-len", 512 << 20)  # the operator's fix
    await asyncio.sleep(2 * RECHECK_S)
    more = tokens + tuple(range(10**6, 10**6 + ps))  # a longer prompt: its backup writes past the hints
    write_prefix(mgr, more, start=3 * ps)
    await mgr.drain()
    assert store.refusals.writes is None  # lifted by the write
    assert sync.exists(*store.page_keys(more, 0, 4 * ps)) == 4, "the stale prefix was never written again"
    mgr.check_integrity()
    await mgr.close()

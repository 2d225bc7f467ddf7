"""The shared Redis L3's hints going stale under an engine that serves the prefix from L1/L2: the
server flushed, restarted empty, or evicting the keys (maxmemory + allkeys-lru) while this engine's
tree still hints them in L3 (hicache/storage_redis.py, hicache/backups.py).

Tests start `redis-server` on a free loopback port (skipped without the binary)."""
from __future__ import annotations

import os

import pytest

from redis_server import needs_redis, private_server, redis_server, server  # noqa: F401
from scheduler.engine import Engine
from test_redis_engine import P1, P2, engine_config, reference, serve

# P1's 11 full pages are all in A's L1 (no hint query), its last 2 tokens and the output make a new page
P1_MORE = P1 + [9, 9]


def _lose_pages(how: str, srv, keys: list[bytes]) -> None:
    """The shared store loses `keys` behind the engine's back."""
    sync = srv.client()
    if how == "flushall":
        sync.flushall()
    elif how == "restart":
        srv.stop()
        srv.start()  # same port, empty
    else:  # "evicted": Redis's LRU pushes the (older) pages out for newer data
        used = sync.info("memory")["used_memory"]
        sync.config_set("maxmemory-policy", "allkeys-lru")
        sync.config_set("maxmemory", used + 200_000)
        for i in range(100):
            sync.set(f"junk:{i}", os.urandom(20_000))
        sync.config_set("maxmemory", 0)  # room again for the pages written from now on
    assert sync.exists(*keys) < len(keys)


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["kept", "flushall", "restart", "evicted"])
async def test_pages_lost_from_redis_are_written_again_by_an_engine_holding_them(private_server, how):
    """regression: an engine that holds a prefix in L1/L2 skips the hint query (by design), and its
    backups trusted the stale L3 hints and wrote only the new pages: after a flush, a restart or an
    LRU eviction, the prefix never reached Redis again and other engines lost its shared hits."""
    url = private_server.url()
    a = Engine(engine_config(url))
    a.cache.store.backoff_s = (0.0, 0.0)
    assert await serve(a, [P1]) == await reference([P1])
    keys = a.cache.store.page_keys(P1, 0, 44)
    assert private_server.client().exists(*keys) == 11
    if how != "kept":
        _lose_pages(how, private_server, keys)
    store = a.cache.store
    written = store.counters["pages_written"]
    assert await serve(a, [P1_MORE]) == await reference([P1_MORE])
    assert store.counters["hint_queries"] == 1  # (the second request's pages were all in L1)
    assert store.counters["hint_rechecks"] == 1  # one existence check for the backup's L3 write
    # its new page, and the prefix again where the store lost it
    assert store.counters["pages_written"] - written == (1 if how == "kept" else 12)
    assert not a.metrics()["failures"]
    a.check_integrity()
    assert private_server.client().exists(*keys) == 11  # the prefix is back in the shared store
    b = Engine(engine_config(url, prefetch=False))
    assert await serve(b, [P2]) == await reference([P2])
    assert b.metrics()["hit_tokens"]["l3"] == 40 and not b.metrics()["failures"]
    await a.shutdown()
    await b.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_metrics_export_the_redis_stores_counters_stale_hints_included(private_server):
    """regression: stale hints dropped (pages the server lost behind the tree) were counted only in
    the store's own `stale_hints_dropped`, which /metrics did not export."""
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler.prom import ServerMetrics

    a = Engine(engine_config(private_server.url()))
    a.cache.store.backoff_s = (0.0, 0.0)
    metrics = ServerMetrics(a)
    await serve(a, [P1])
    _lose_pages("flushall", private_server, a.cache.store.page_keys(P1, 0, 44))
    await serve(a, [P1_MORE])
    counters = a.cache.store.counters
    assert counters["stale_hints_dropped"] > 0
    events = {s.labels["event"]: s.value for fam in text_string_to_metric_families(metrics.render().decode())
              if fam.name == "hicache_redis_events" for s in fam.samples if s.name.endswith("_total")}
    assert events["stale_hints_dropped"] == counters["stale_hints_dropped"]
    assert events["pages_written"] == counters["pages_written"] > 0
    assert events["hint_queries"] == counters["hint_queries"]
    await a.shutdown()

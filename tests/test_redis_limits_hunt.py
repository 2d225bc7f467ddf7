"""Redis servers whose client buffer limits (client-output-buffer-limit normal,
client-query-buffer-limit) are below what the store's commands need (hicache/storage_redis.py).

Tests start `redis-server` on a free loopback port of their own (skipped without the binary)."""
from __future__ import annotations

import pytest
import torch

from hicache.geometry import KVGeometry
from hicache.storage import StorageError
from hicache_helpers import capture_op_logs
from scheduler.engine import Engine
from redis_server import GEOM, needs_redis, private_server, random_pages, same_bytes  # noqa: F401

BIG = KVGeometry(num_layers=2, num_kv_heads=8, head_dim=128, page_size=128, dtype=torch.float32)  # 2 MiB pages


def make_store(url: str, geometry: KVGeometry = GEOM, **kw):
    from hicache.storage_redis import RedisStore
    return RedisStore(geometry, 64, url, model_id="test", **kw)


def l3_events(logs: list[dict]) -> dict[str, dict]:
    return {e["event"]: e for e in logs if e["event"].startswith("l3_redis_")}


@needs_redis
@pytest.mark.asyncio
async def test_reads_fit_a_low_output_buffer_limit(private_server):
    """regression: a server whose `client-output-buffer-limit normal` hard limit (1 MiB here) was
    below one MGET reply (8 MiB chunks) closed the connection of every read: each restore failed as
    "eio" after a retry, with a back-off that stopped hints too, and nothing naming the setting.
    Now the store reads the limit at start and sizes its MGET chunks to fit."""
    url, sync = private_server.url(), private_server.client()
    sync.config_set("client-output-buffer-limit", "normal 1048576 0 0")
    store = make_store(url)
    n = 600  # 2.4 MiB of 4 KiB pages: one 8 MiB chunk before
    src = random_pages(GEOM, n)
    keys = store.page_keys(list(range(n * 4)), 0, n * 4)
    slots = [i % 64 for i in range(n)]
    await store.write_pages(src, range(n), slots, keys)
    dst = torch.zeros_like(src)
    await store.read_pages(slots, dst, range(n), keys)
    assert same_bytes(dst, src) and store.errors == {} and store.stats()["available"]
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_page_over_the_output_buffer_limit_is_named_at_start(private_server):
    """regression: with `client-output-buffer-limit normal` below one page's value no read can ever
    succeed: every restore failed as "eio" with a back-off (stopping hints and writes too) and no
    message naming the cause. Now one warning at start names the setting and the page size, hints
    are not queried (no restore is tried), reads fail at once without a back-off, writes go on."""
    url, sync = private_server.url(), private_server.client()
    sync.config_set("client-output-buffer-limit", "normal 1048576 0 0")
    with capture_op_logs() as logs:
        store = make_store(url, BIG)
    warning = l3_events(logs).get("l3_redis_reply_too_large")
    assert warning is not None, sorted(l3_events(logs))
    assert "client-output-buffer-limit" in warning["fix"] and warning["page_size_tokens"] == 128
    src = random_pages(BIG, 2)
    keys = store.page_keys(list(range(256)), 0, 256)
    await store.write_pages(src, [0, 1], [0, 1], keys)  # writes are unaffected
    with pytest.raises(StorageError) as exc:
        await store.read_pages([0, 1], torch.zeros_like(src), [0, 1], keys)
    assert "client-output-buffer-limit" in str(exc.value)
    assert store.stats()["available"] and store.counters["round_trips"] == 1  # the write's only
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_page_over_the_query_buffer_limit_is_named_at_start(private_server):
    """regression: a server whose client-query-buffer-limit (default 1 GiB, as low as 1 MiB) is below
    one page's value closed the connection of every write (proto-max-bulk-len allowing it): each
    backup failed as "eio" with a back-off that stopped hints and reads too, and nothing named the
    setting. Now, like proto-max-bulk-len: one warning at start, writes refused at once, reads go on."""
    url, sync = private_server.url(), private_server.client()
    src = random_pages(BIG, 2)
    before = make_store(url, BIG)  # pages written before the limit was lowered
    keys = before.page_keys(list(range(256)), 0, 256)
    await before.write_pages(src, [0, 1], [0, 1], keys)
    await before.aclose()
    sync.config_set("client-query-buffer-limit", 1 << 20)
    with capture_op_logs() as logs:
        store = make_store(url, BIG)
    warning = l3_events(logs).get("l3_redis_value_too_large")
    assert warning is not None, sorted(l3_events(logs))
    assert "client-query-buffer-limit" in warning["fix"] and warning["page_size_tokens"] == 128
    with pytest.raises(StorageError) as exc:
        await store.write_pages(src, [0, 1], [0, 1], keys)
    assert exc.value.kind == "enospc" and "client-query-buffer-limit" in str(exc.value)
    assert store.counters["round_trips"] == 0 and store.stats()["available"]
    dst = torch.zeros_like(src)
    await store.read_pages([0, 1], dst, [0, 1], keys)
    assert same_bytes(dst, src)
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_an_engine_does_not_try_restores_a_server_cannot_send_back(private_server):
    """regression: engine B, on a server whose output buffer limit is below one page's value, took
    hints of A's pages and tried to restore them: each read failed as "eio" (counted as a failure)
    and backed off. Now B queries no hints, tries no restore and recomputes: outputs equal."""
    from test_redis_engine import P1, engine_config, reference, serve, serve_once

    url, sync = private_server.url(), private_server.client()
    assert await serve_once(engine_config(url), [P1]) == await reference([P1])
    probe = Engine(engine_config(url, prefetch=False))
    sync.config_set("client-output-buffer-limit", f"normal {probe.cache.store.value_bytes} 0 0")
    await probe.shutdown()
    with capture_op_logs() as logs:
        b = Engine(engine_config(url, prefetch=False))
    assert await serve(b, [P1]) == await reference([P1])
    m, store = b.metrics(), b.cache.store
    assert m["failures"] == {} and m["hit_tokens"]["l3"] == 0, m["failures"]
    assert store.counters["hint_queries"] == 0 and store.errors == {}
    assert "l3_redis_reply_too_large" in l3_events(logs)
    await b.shutdown()

"""A Redis server whose limits refuse a page's value, then change while the engine runs: the store
reads them again (hicache/redis_limits.py, `Refusals`) when a refused write or read is attempted,
at most once every LIMITS_RECHECK_S (injected tiny here), so an operator's CONFIG SET brings L3
back without restarting the engine, and a limit lowered at runtime refuses again.

Tests start `redis-server` on a free loopback port of their own (skipped without the binary)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hicache import redis_limits
from hicache.geometry import KVGeometry
from hicache.storage import StorageError
from hicache_helpers import capture_op_logs
from redis_server import needs_redis, private_server, random_pages, same_bytes  # noqa: F401

BIG = KVGeometry(num_layers=2, num_kv_heads=8, head_dim=128, page_size=128, dtype=torch.float32)  # 2 MiB pages
APP_USER = ("ACL", "SETUSER", "app", "reset", "on", ">pw", "~hicache:*", "+@all", "-@dangerous")  # no CONFIG
RECHECK_S = 0.01  # the injected interval; each wait below is just past it
OUTPUT_LIMIT = "client-output-buffer-limit"


def make_store(url: str, geometry: KVGeometry = BIG, **kw):
    from hicache.storage_redis import RedisStore
    return RedisStore(geometry, 64, url, model_id="test", **kw)


def l3_events(logs: list[dict]) -> list[str]:
    return [e["event"] for e in logs if e["event"].startswith("l3_redis_")]


def config_calls(sync) -> int:
    """CONFIG GET calls the server has answered (redis 7 counts subcommands apart)."""
    stats = sync.info("commandstats")
    return sum(stats.get(k, {}).get("calls", 0) for k in ("cmdstat_config|get", "cmdstat_config"))


async def past_interval() -> None:
    await asyncio.sleep(2 * RECHECK_S)


async def refused_write(store, src, keys) -> StorageError:
    with pytest.raises(StorageError) as exc:
        await store.write_pages(src, range(len(keys)), range(len(keys)), keys)
    assert exc.value.kind == "enospc" and "proto-max-bulk-len" in str(exc.value)
    return exc.value


async def refused_read(store, src, keys) -> StorageError:
    with pytest.raises(StorageError) as exc:
        await store.read_pages(range(len(keys)), torch.zeros_like(src), range(len(keys)), keys)
    assert exc.value.kind == "eio" and OUTPUT_LIMIT in str(exc.value)
    return exc.value


async def round_trips(store, src, keys) -> None:
    n = len(keys)
    await store.write_pages(src, range(n), range(n), keys)
    dst = torch.zeros_like(src)
    await store.read_pages(range(n), dst, range(n), keys)
    assert same_bytes(dst, src)


@needs_redis
@pytest.mark.asyncio
async def test_a_refused_write_between_rechecks_fails_at_once_and_the_fix_needs_no_restart(private_server):
    """regression: the warning told the operator to CONFIG SET the limit "and restart the engine"
    (the refusal was for good). Now it says the store checks again within the interval; between
    rechecks a refused write still fails at once: no round trip, no CONFIG GET, no new log line."""
    url, sync = private_server.url(), private_server.client()
    sync.config_set("proto-max-bulk-len", 1 << 20)
    with capture_op_logs() as logs:
        store = make_store(url, limits_recheck_s=3600.0)
    warning = next(e for e in logs if e["event"] == "l3_redis_value_too_large")
    assert "restart" not in warning["fix"] and "3600 s" in warning["fix"], warning["fix"]
    sync.config_set("proto-max-bulk-len", 512 << 20)  # fixed, but not yet read again
    src = random_pages(BIG, 1)
    keys = store.page_keys(list(range(128)), 0, 128)
    calls = config_calls(sync)
    with capture_op_logs() as logs:
        for _ in range(3):
            await refused_write(store, src, keys)
    assert l3_events(logs) == [] and store.counters["round_trips"] == 0
    assert config_calls(sync) == calls and store.stats()["available"]
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_raised_proto_max_bulk_len_lifts_the_write_refusal(private_server):
    """regression: writes refused at start (proto-max-bulk-len below one page's value) stayed
    refused after the operator raised the limit: only an engine restart brought L3 writes back.
    Now the next write after the interval reads the limits again: unchanged, nothing new is logged;
    raised, the refusal is lifted (one info line naming the setting) and a page round-trips;
    lowered again at runtime, the next write's failure refuses again (one warning)."""
    url, sync = private_server.url(), private_server.client()
    sync.config_set("proto-max-bulk-len", 1 << 20)
    store = make_store(url, limits_recheck_s=RECHECK_S)
    src = random_pages(BIG, 2)
    keys = store.page_keys(list(range(256)), 0, 256)
    calls = config_calls(sync)
    with capture_op_logs() as logs:
        await past_interval()
        await refused_write(store, src, keys)
    assert config_calls(sync) > calls and l3_events(logs) == []  # read again, unchanged: no log
    sync.config_set("proto-max-bulk-len", 512 << 20)
    await past_interval()
    with capture_op_logs() as logs:
        await round_trips(store, src, keys)
    lifted = [e for e in logs if e["event"] == "l3_redis_limits_lifted"]
    assert len(lifted) == 1 and lifted[0]["setting"] == "proto-max-bulk-len"
    assert store.stats()["writes_refused"] is None and store.errors == {"enospc": 1}
    sync.config_set("proto-max-bulk-len", 1 << 20)  # lowered at runtime
    with capture_op_logs() as logs:
        await refused_write(store, src, keys)
        await refused_write(store, src, keys)
    assert l3_events(logs) == ["l3_redis_value_too_large"] and store.stats()["available"]
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("num_pages", [1, 3])  # the server's answer arrives / the connection is reset
async def test_a_user_without_config_tries_a_write_again_after_the_interval(private_server, num_pages):
    """regression: where CONFIG GET is refused (an application ACL), the first write's failure
    refused writes for good. Now, after the interval, the next write is a trial: its failure refuses
    again without a new warning; once the limit is raised it succeeds (one info line); a limit
    lowered again refuses again with one warning."""
    url = f"redis://app:pw@127.0.0.1:{private_server.port}/0"
    sync = private_server.client()
    sync.execute_command(*APP_USER)
    sync.config_set("proto-max-bulk-len", 1 << 20)
    store = make_store(url, limits_recheck_s=RECHECK_S)
    src = random_pages(BIG, num_pages)
    keys = store.page_keys(list(range(num_pages * 128)), 0, num_pages * 128)
    with capture_op_logs() as logs:
        await refused_write(store, src, keys)
        await past_interval()
        await refused_write(store, src, keys)  # the trial
    assert l3_events(logs) == ["l3_redis_value_too_large"]  # one warning, not one a trial
    sync.config_set("proto-max-bulk-len", 512 << 20)
    await past_interval()
    with capture_op_logs() as logs:
        await round_trips(store, src, keys)
    assert l3_events(logs) == ["l3_redis_limits_lifted"]
    sync.config_set("proto-max-bulk-len", 1 << 20)
    with capture_op_logs() as logs:
        await refused_write(store, src, keys)
    assert l3_events(logs) == ["l3_redis_value_too_large"]
    assert store.stats()["available"] and store.errors == {"enospc": 3}
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_raised_output_buffer_limit_lifts_the_read_refusal(private_server):
    """regression: reads refused at start (client-output-buffer-limit normal below one page's value)
    stayed refused after the operator raised the limit. Now the next read after the interval reads
    the limits again: unchanged, nothing new is logged; raised to 4 MiB, the refusal is lifted and
    MGET chunks follow the new limit (one 2 MiB page a reply: 3 round trips for 3 pages, where one
    6 MiB reply would be dropped); lowered again at runtime, the read whose reply is dropped reads
    the limits again and refuses reads (one warning, no back-off)."""
    url, sync = private_server.url(), private_server.client()
    sync.config_set(OUTPUT_LIMIT, "normal 1048576 0 0")
    store = make_store(url, limits_recheck_s=RECHECK_S)
    src = random_pages(BIG, 3)
    keys = store.page_keys(list(range(3 * 128)), 0, 3 * 128)
    await store.write_pages(src, range(3), range(3), keys)  # writes go on
    calls = config_calls(sync)
    with capture_op_logs() as logs:
        await past_interval()
        await refused_read(store, src, keys)
    assert config_calls(sync) > calls and l3_events(logs) == []
    sync.config_set(OUTPUT_LIMIT, f"normal {4 << 20} 0 0")
    await past_interval()
    before = store.counters["round_trips"]
    dst = torch.zeros_like(src)
    with capture_op_logs() as logs:
        await store.read_pages(range(3), dst, range(3), keys)
    assert same_bytes(dst, src) and store.counters["round_trips"] - before == 3
    lifted = [e for e in logs if e["event"] == "l3_redis_limits_lifted"]
    assert len(lifted) == 1 and lifted[0]["setting"] == OUTPUT_LIMIT
    sync.config_set(OUTPUT_LIMIT, "normal 1048576 0 0")  # lowered at runtime
    await past_interval()
    with capture_op_logs() as logs:
        await refused_read(store, src, keys)  # its reply dropped: the limits read again
        await refused_read(store, src, keys)
    assert l3_events(logs) == ["l3_redis_reply_too_large"]
    assert store.stats()["available"] and store.stats()["reads_refused"] is not None
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_an_engine_restores_again_once_its_server_can_send_pages_back(private_server, monkeypatch):
    """regression: an engine whose server could not send back a page's value at start never queried
    hints again (no restore tried), even after the operator raised client-output-buffer-limit: only
    a restart brought L3 hits back. Now a hint refresh after the interval reads the limits again."""
    from scheduler.engine import Engine
    from test_redis_engine import BASE, P1, engine_config, reference, serve, serve_once

    monkeypatch.setattr(redis_limits, "LIMITS_RECHECK_S", RECHECK_S)
    longer = BASE + list(range(100, 112))  # pages past P1's: only Redis holds them for B
    url, sync = private_server.url(), private_server.client()
    assert await serve_once(engine_config(url), [longer]) == await reference([longer])
    probe = Engine(engine_config(url, prefetch=False))
    sync.config_set(OUTPUT_LIMIT, f"normal {probe.cache.store.value_bytes} 0 0")
    await probe.shutdown()
    b = Engine(engine_config(url, prefetch=False))
    assert await serve(b, [P1]) == await reference([P1])
    assert b.metrics()["hit_tokens"]["l3"] == 0 and b.cache.store.counters["hint_queries"] == 0
    sync.config_set(OUTPUT_LIMIT, "normal 0 0 0")
    await past_interval()
    assert await serve(b, [longer]) == await reference([longer])
    m = b.metrics()
    assert m["hit_tokens"]["l3"] > 0 and m["failures"] == {}, m
    await b.shutdown()

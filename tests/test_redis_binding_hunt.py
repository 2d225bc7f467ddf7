"""The Redis L3's values bound to their keys, servers that refuse a page-sized value, and what a
running engine sees when its Redis restarts, evicts, is flushed or hands back a cut value
(hicache/storage_redis.py).

Tests that need a server start `redis-server` on a free loopback port (skipped without the binary)."""
from __future__ import annotations

import random
import threading
import time

import pytest
import redis
import torch

from hicache.geometry import KVGeometry
from hicache.storage import StorageError
from hicache_helpers import capture_op_logs
from redis_server import (GEOM, needs_redis, private_server, random_pages, redis_server, same_bytes,  # noqa: F401
                          server)
from scheduler.engine import Engine
from test_redis_engine import P1, engine_config, reference, serve, serve_once


def make_store(url: str, geometry: KVGeometry = GEOM, model_id: str = "test", **kw):
    from hicache.storage_redis import RedisStore
    return RedisStore(geometry, 64, url, model_id=model_id, **kw)


def _geom(**changes) -> KVGeometry:
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32)
    fields.update(changes)
    return KVGeometry(**fields)


# ---- a value under another key ---------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("checksum", [True, False])
async def test_a_valid_value_under_another_key_is_refused(server, checksum):
    """regression: a value held only its payload's checksum, so a valid page copied to another key
    (another prefix's, by a buggy client or a tool that moved keys) was accepted and its KV restored
    into the wrong prefix; with checksums off too."""
    store = make_store(server.url(), checksum=checksum)
    src = random_pages(GEOM, 3)
    tokens, other = list(range(12)), list(range(100, 112))
    keys, other_keys = store.page_keys(tokens, 0, 12), store.page_keys(other, 0, 12)
    await store.write_pages(src, [0, 1, 2], [0, 1, 2], keys)
    sync = server.client()
    for k, o in zip(keys, other_keys):
        sync.set(o, sync.get(k))
    dst = torch.zeros_like(src)
    await store.read_pages([0, 1, 2], dst, [0, 1, 2], keys)  # its own keys read back
    assert same_bytes(dst, src)
    with pytest.raises(StorageError) as exc:
        await store.read_pages([5, 6, 7], torch.zeros_like(src), [0, 1, 2], other_keys)
    assert exc.value.kind == "checksum" and exc.value.bad_slots == (5, 6, 7)
    assert store.stats()["corrupt_pages"] == 3 and not sync.exists(*other_keys)  # deleted: a writer replaces them
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("change", [
    {"model_id": "other"}, {"page_size": 8, "num_layers": 1}, {"dtype": torch.bfloat16, "head_dim": 32},
    {"num_kv_heads": 4, "head_dim": 8}, {"rank": 1}])
@pytest.mark.parametrize("checksum", [True, False])
async def test_pages_of_another_model_or_layout_never_read_as_valid(server, change, checksum):
    """Two stores whose pages are not interchangeable (model, page size, dtype, KV geometry, rank;
    each change here keeps the page's byte size) have different keys; and a page of one copied
    under the other's key (a collision, or a tool that moved keys) is refused, checksums off too."""
    change = dict(change)
    model_id, rank = change.pop("model_id", "test"), change.pop("rank", 0)
    geom = _geom(**change)
    assert geom.bytes_per_page == GEOM.bytes_per_page
    a, b = make_store(server.url()), make_store(server.url(), geom, model_id, rank=rank, checksum=checksum)
    tokens = list(range(16))
    keys_a, keys_b = a.page_keys(tokens, 0, 8), b.page_keys(tokens, 0, 2 * geom.page_size)
    assert not set(keys_a) & set(keys_b)
    src = random_pages(GEOM, 2)
    await a.write_pages(src, [0, 1], [0, 1], keys_a)
    assert await b.count_present(keys_b) == 0
    sync = server.client()
    for k, o in zip(keys_a, keys_b):
        sync.set(o, sync.get(k))
    with pytest.raises(StorageError) as exc:
        await b.read_pages([0, 1], torch.zeros_like(src), [0, 1], keys_b)
    assert exc.value.kind == "checksum"
    # the same model and layout in another engine still reads them (the shared store's point)
    c = make_store(server.url())
    dst = torch.zeros_like(src)
    await c.read_pages([3, 4], dst, [0, 1], keys_a)
    assert same_bytes(dst, src)
    for s in (a, b, c):
        await s.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_an_engine_does_not_restore_pages_copied_from_another_prefix(server):
    """regression: engine B restored engine A's KV copied under the keys of B's own prompt and
    answered with the wrong prefix's output; now the read fails as a checksum mismatch and the
    request recomputes."""
    url, sync = server.url(), server.client()
    assert await serve_once(engine_config(url), [P1]) == await reference([P1])
    b = Engine(engine_config(url, prefetch=False))
    store = b.cache.store
    other = [random.Random(3).randrange(512) for _ in range(40)] + [4, 5, 6]  # another 40-token prefix
    for k, o in zip(store.page_keys(P1, 0, 40), store.page_keys(other, 0, 40)):
        sync.set(o, sync.get(k))
    assert await serve(b, [other]) == await reference([other])  # (P1's KV gives other output)
    m = b.metrics()
    assert m["failures"].get("checksum", 0) == 1 and m["fallbacks"] >= 1 and m["hit_tokens"]["l3"] == 0
    assert store.counters["corrupt_pages"] >= 1
    await b.shutdown()


# ---- a server that refuses a page-sized value -------------------------------------------------------
BIG = KVGeometry(num_layers=2, num_kv_heads=8, head_dim=128, page_size=128, dtype=torch.float32)  # 2 MiB pages
APP_USER = ("ACL", "SETUSER", "app", "reset", "on", ">pw", "~hicache:*", "+@all", "-@dangerous")  # no CONFIG


def l3_events(logs: list[dict]) -> dict[str, dict]:
    return {e["event"]: e for e in logs if e["event"].startswith("l3_redis_")}


@needs_redis
@pytest.mark.asyncio
async def test_a_server_refusing_page_sized_values_is_named_at_start(private_server):
    """regression: a server whose proto-max-bulk-len (default 512 MiB, as low as 1 MiB) is below one
    page's value reset every write's connection: each backup failed as "eio" after sending its pages,
    and the back-off that followed stopped hint queries and reads of pages already there too, with
    nothing naming the setting. Now one warning at start names it and the page size, writes fail at
    once (nothing sent), and reads go on."""
    from hicache.storage_redis import HEADER

    url, sync = private_server.url(), private_server.client()
    src = random_pages(BIG, 3)
    keys = make_store(url, BIG).page_keys(list(range(3 * 128)), 0, 3 * 128)
    before = make_store(url, BIG)  # pages written before the limit was lowered
    await before.write_pages(src, [0, 1], [0, 1], keys[:2])
    await before.aclose()
    sync.config_set("proto-max-bulk-len", 1 << 20)
    with capture_op_logs() as logs:
        store = make_store(url, BIG)
    warning = l3_events(logs)["l3_redis_value_too_large"]
    assert warning["proto_max_bulk_len"] == 1 << 20 and warning["value_bytes"] == HEADER.size + BIG.bytes_per_page
    assert warning["page_size_tokens"] == 128 and "proto-max-bulk-len" in warning["fix"]
    with pytest.raises(StorageError) as exc:
        await store.write_pages(src, [0, 1, 2], [0, 1, 2], keys)
    assert exc.value.kind == "enospc" and "proto-max-bulk-len" in str(exc.value)
    assert store.counters["round_trips"] == 0 and store.stats()["available"]
    dst = torch.zeros_like(src)
    await store.read_pages([0, 1], dst, [0, 1], keys[:2])
    assert same_bytes(dst[:2], src[:2]) and await store.count_present(keys) == 2
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("num_pages", [1, 3])  # the server's answer arrives / the connection is reset
async def test_a_user_without_config_learns_the_limit_from_the_first_write(private_server, num_pages):
    """The same server seen by an application user that may not run CONFIG: the start cannot tell,
    the first write's failure does (the server answers "invalid bulk length", or resets the
    connection while a few MiB are still being sent): one warning, no back-off (hints and reads go
    on), later writes fail at once."""
    url = f"redis://app:pw@127.0.0.1:{private_server.port}/0"
    sync = private_server.client()
    sync.execute_command(*APP_USER)
    sync.config_set("proto-max-bulk-len", 1 << 20)
    with capture_op_logs() as logs:
        store = make_store(url, BIG)
    assert "l3_redis_value_too_large" not in l3_events(logs) and "l3_redis_unreachable" not in l3_events(logs)
    src = random_pages(BIG, num_pages)
    keys = store.page_keys(list(range(num_pages * 128)), 0, num_pages * 128)
    for attempt in range(2):
        with capture_op_logs() as logs:
            with pytest.raises(StorageError) as exc:
                await store.write_pages(src, range(num_pages), range(num_pages), keys)
        assert exc.value.kind == "enospc" and "proto-max-bulk-len" in str(exc.value)
        assert ("l3_redis_value_too_large" in l3_events(logs)) == (attempt == 0)  # one warning
        assert store.stats()["available"] and store.errors == {"enospc": attempt + 1}
    assert await store.count_present(keys) == 0  # not backing off: the server answers
    await store.aclose()


# ---- the server's passing states ---------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("error", [
    redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
    redis.exceptions.MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
    redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"),
], ids=["OOM", "MASTERDOWN", "LOADING"])
async def test_a_passing_server_state_whose_message_lost_its_code_does_not_turn_the_hint_script_off(
        private_server, monkeypatch, error):
    """Session 51, regression: redis-py 8 strips the code from OOM's and MASTERDOWN's messages (they have classes of
    their own), so the check of the message's start never matched: a replica whose master was down turned the hint
    script off for good ("l3_redis_no_scripting"), and the pages it hinted lost their LRU refresh."""
    url = private_server.url()
    store = make_store(url)
    keys = store.page_keys(list(range(8)), 0, 8)
    store._client()  # (the client, and its script, of this loop)
    script = store._prefix_script

    async def refused(**kw):
        raise error
    monkeypatch.setattr(store, "_prefix_script", refused)
    with capture_op_logs() as logs:
        with pytest.raises(StorageError) as exc:
            await store.count_present(keys)
    assert exc.value.kind in ("eio", "enospc") and "l3_redis_no_scripting" not in l3_events(logs) and store._script_ok
    monkeypatch.setattr(store, "_prefix_script", script)
    store._down_until = 0  # (past the back-off the error started)
    sync = private_server.client()
    calls = sync.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert await store.count_present(keys) == 0
    assert sync.info("commandstats")["cmdstat_evalsha"]["calls"] > calls  # the script again
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_busy_server_does_not_turn_the_hint_script_off(private_server):
    """regression: a hint query that met BUSY (another client's slow script on the shared server)
    was taken for scripting being refused: "l3_redis_no_scripting" was logged and the store queried
    with plain EXISTS from then on (the pages it hinted no longer had their LRU age refreshed)."""
    url, sync = private_server.url(), private_server.client()
    sync.config_set("busy-reply-threshold", 20)
    store = make_store(url)
    src = random_pages(GEOM, 2)
    keys = store.page_keys(list(range(8)), 0, 8)
    await store.write_pages(src, [0, 1], [0, 1], keys)
    busy = threading.Thread(target=lambda: pytest.raises(redis.exceptions.ResponseError, private_server.client().eval,
                                                         "while true do end", 0), daemon=True)
    busy.start()
    try:
        for _ in range(1000):  # until the server answers BUSY
            try:
                sync.exists("probe")
            except redis.exceptions.ResponseError:
                break
            time.sleep(0.01)
        with capture_op_logs() as logs:
            with pytest.raises(StorageError) as exc:
                await store.count_present(keys)
        assert exc.value.kind == "eio" and "BUSY" in str(exc.value)
        assert "l3_redis_no_scripting" not in l3_events(logs)
    finally:
        sync.script_kill()
        busy.join(10)
    evalsha_calls = sync.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert await store.count_present(keys) == 2
    assert sync.info("commandstats")["cmdstat_evalsha"]["calls"] > evalsha_calls  # the script again
    await store.aclose()

"""Shared L3 on Redis (hicache/storage_redis.py, hicache/page_keys.py): content keys, the store's
page I/O and its failure modes (engines sharing one Redis: tests/test_redis_engine.py).

Tests that need a server start `redis-server` on a free loopback port (skipped without the binary)."""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
import torch

from hicache.geometry import KVGeometry
from hicache.page_keys import PageKeyer, kv_salt, page_keys
from hicache.storage import StorageError
from redis_server import (GEOM, RedisServer, refused_url, needs_redis, random_pages, redis_server,  # noqa: F401
                          same_bytes, server)


# ---- page keys (no server needed) ------------------------------------------------------------------
def _geom(**changes) -> KVGeometry:
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32)
    fields.update(changes)
    return KVGeometry(**fields)


def test_same_prefix_same_model_same_keys():
    salt = kv_salt("tiny:seed0:cpu", GEOM)
    a = list(range(100, 140))
    b = a[:24] + [7] * 16  # shares 6 pages with a
    ka, kb = page_keys(salt, a, 0, 40, 4), page_keys(salt, b, 0, 40, 4)
    assert len(ka) == 10 and len(set(ka)) == 10 and all(len(k) == 32 for k in ka)
    assert ka[:6] == kb[:6] and not set(ka[6:]) & set(kb[6:])
    assert page_keys(kv_salt("tiny:seed0:cpu", _geom()), a, 0, 40, 4) == ka  # a fresh salt, same identity
    assert page_keys(salt, a, 8, 20, 4) == ka[2:5]


@pytest.mark.parametrize("change", [
    {"model_id": "tiny:seed1:cpu"}, {"dtype": torch.bfloat16}, {"page_size": 8}, {"num_layers": 3},
    {"num_kv_heads": 4}, {"head_dim": 32}, {"rank": 1}])
def test_anything_that_changes_kv_bytes_changes_keys(change):
    tokens = list(range(64))
    base = page_keys(kv_salt("tiny:seed0:cpu", _geom()), tokens, 0, 64, 4)
    model_id = change.pop("model_id", "tiny:seed0:cpu")
    rank = change.pop("rank", 0)
    geom = _geom(**change)
    other = page_keys(kv_salt(model_id, geom, rank=rank), tokens, 0, 64, geom.page_size)
    assert not set(base) & set(other)


def test_keys_are_chained():
    salt = kv_salt("m", GEOM)
    tokens = list(range(32))
    keys = page_keys(salt, tokens, 0, 32, 4)
    changed_first = page_keys(salt, [999] + tokens[1:], 0, 32, 4)
    assert not set(keys) & set(changed_first)  # every page depends on token 0
    changed_mid = tokens[:13] + [999] + tokens[14:]  # token 13 is in page 3
    k2 = page_keys(salt, changed_mid, 0, 32, 4)
    assert k2[:3] == keys[:3] and not set(k2[3:]) & set(keys[3:])
    # the same page content at another position (or after another prefix) has another key
    assert page_keys(salt, [1, 2, 3, 4] * 2, 0, 8, 4)[0] != page_keys(salt, [1, 2, 3, 4] * 2, 0, 8, 4)[1]


def test_key_ranges_must_be_page_aligned():
    salt = kv_salt("m", GEOM)
    with pytest.raises(ValueError, match="aligned"):
        page_keys(salt, list(range(16)), 2, 8, 4)
    with pytest.raises(ValueError, match="outside"):
        page_keys(salt, list(range(16)), 0, 20, 4)
    with pytest.raises(ValueError, match="outside"):
        PageKeyer(salt, 4).keys(list(range(16)), 8, 4)


def test_keyer_cache_matches_uncached():
    salt = kv_salt("m", GEOM)
    keyer = PageKeyer(salt, 4, cache_entries=4)
    rng = random.Random(1)
    bases = [[rng.randrange(500) for _ in range(64)] for _ in range(3)]
    for _ in range(200):
        tokens = rng.choice(bases)[: rng.randrange(0, 65)] + [rng.randrange(500)] * rng.randrange(0, 9)
        end = rng.randrange(0, len(tokens) // 4 + 1) * 4
        start = rng.randrange(0, end // 4 + 1) * 4
        assert keyer.keys(tokens, start, end) == page_keys(salt, tokens, start, end, 4)
    assert keyer.hits > 0 and len(keyer._cache) <= 4


# ---- the store ------------------------------------------------------------------------------------
def make_store(url: str, geometry: KVGeometry = GEOM, model_id: str = "test", **kw):
    from hicache.storage_redis import RedisStore
    return RedisStore(geometry, 64, url, model_id=model_id, **kw)


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pages_per_chunk", [1024, 2])
async def test_round_trip_byte_identical(server, dtype, pages_per_chunk):
    geom = _geom(dtype=dtype)
    store = make_store(server.url(), geom)
    store.pages_per_chunk = pages_per_chunk
    src = random_pages(geom, 12, seed=3)
    tokens = list(range(48))
    keys = store.page_keys(tokens, 0, 28)
    assert all(k.startswith(b"hicache:kv:") for k in keys)
    wrote = await store.write_pages(src, [0, 1, 2, 5, 6, 9, 11], [3, 4, 20, 21, 22, 7, 8], keys)
    assert wrote.num_bytes == 7 * geom.bytes_per_page
    assert wrote.num_extents == -(-7 // pages_per_chunk)  # round trips
    dst = torch.zeros_like(src)
    read = await store.read_pages([3, 4, 20, 21, 22, 7, 8], dst, [11, 10, 9, 8, 7, 6, 5], keys)
    assert read.num_bytes == wrote.num_bytes
    for i, h in enumerate([0, 1, 2, 5, 6, 9, 11]):
        assert same_bytes(dst[11 - i], src[h])
    value = server.client().get(keys[0])
    assert len(value) == 24 + geom.bytes_per_page and value[:4] == b"HKV2"
    assert await store.count_present(store.page_keys(tokens, 0, 48)) == 7
    st = store.stats()
    assert st["pages_written"] == st["pages_read"] == 7 and st["errors"] == {}
    await store.aclose()
    with pytest.raises(StorageError) as exc:
        store.read_pages([0], dst, [0], keys[:1])
    assert exc.value.kind == "closed"


@needs_redis
@pytest.mark.asyncio
async def test_missing_key_fails_with_bad_slots(server):
    store = make_store(server.url())
    src = random_pages(GEOM, 4)
    keys = store.page_keys(list(range(16)), 0, 16)
    await store.write_pages(src, [0, 1, 2, 3], [10, 11, 12, 13], keys)
    server.client().delete(keys[2])
    with pytest.raises(StorageError) as exc:
        await store.read_pages([10, 11, 12, 13], torch.zeros_like(src), [0, 1, 2, 3], keys)
    assert exc.value.kind == "missing" and exc.value.bad_slots == (12,)
    assert store.stats()["missing_pages"] == 1 and store.stats()["errors"] == {"missing": 1}
    assert await store.count_present(keys) == 2
    store._script_ok = False  # the EXISTS pipeline (where scripting is refused) agrees
    assert await store.count_present(keys) == 2
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("corruption", ["flip", "truncate", "foreign"])
async def test_corruption_is_detected(server, corruption):
    store = make_store(server.url())
    src = random_pages(GEOM, 3)
    keys = store.page_keys(list(range(12)), 0, 12)
    await store.write_pages(src, [0, 1, 2], [0, 1, 2], keys)
    sync = server.client()
    value = bytearray(sync.get(keys[1]))
    if corruption == "flip":
        value[16 + 100] ^= 0x01
    elif corruption == "truncate":
        del value[-4:]
    else:
        value = bytearray(b"not a page")
    sync.set(keys[1], bytes(value))
    with pytest.raises(StorageError) as exc:
        await store.read_pages([0, 1, 2], torch.zeros_like(src), [0, 1, 2], keys)
    assert exc.value.kind == "checksum" and exc.value.bad_slots == (1,)
    assert not sync.exists(keys[1])  # deleted, so the next writer replaces it
    await store.aclose()


@pytest.mark.asyncio
async def test_unreachable_server_fails_fast_and_counts():
    store = make_store(refused_url(), backoff_s=(0.2, 0.2))
    src = random_pages(GEOM, 2)
    keys = store.page_keys(list(range(8)), 0, 8)
    for op in range(2):  # the second fails at once: the store backs off a dead server
        t0 = time.monotonic()
        with pytest.raises(StorageError) as exc:
            await store.write_pages(src, [0, 1], [0, 1], keys)
        assert exc.value.kind == "eio" and time.monotonic() - t0 < 3
    assert store.stats()["errors"]["eio"] == 1 and not store.stats()["available"]
    with pytest.raises(StorageError):
        await store.read_pages([0, 1], src, [0, 1], keys)
    await asyncio.sleep(0.25)
    with pytest.raises(StorageError):
        await store.count_present(keys)  # tried again after the back-off
    assert store.stats()["errors"]["eio"] == 2
    with pytest.raises(ValueError):
        make_store("http://example.invalid/")
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_password_in_url():
    server = RedisServer(password="s3cret").start()
    try:
        store = make_store(server.url())
        src = random_pages(GEOM, 2)
        keys = store.page_keys(list(range(8)), 0, 8)
        await store.write_pages(src, [0, 1], [0, 1], keys)
        assert server.client().exists(*keys) == 2
        assert "s3cret" not in json.dumps(store.stats()) and ":***@" in store.stats()["url"]
        await store.aclose()
        wrong = make_store(server.url().replace("s3cret", "wrong"))
        with pytest.raises(StorageError) as exc:
            await wrong.write_pages(src, [0, 1], [0, 1], keys)
        assert exc.value.kind == "eio"
        await wrong.aclose()
    finally:
        server.stop()


@pytest.mark.parametrize("url,shown", [
    ("redis://user:s3cret@host:6379/0", "redis://user:***@host:6379/0"),
    ("redis://host:6379/0?password=s3cret", "redis://host:6379/0?password=***"),
    ("redis://host:6379/0?username=u&password=s3cret&socket_timeout=2",
     "redis://host:6379/0?username=***&password=***&socket_timeout=2"),
    ("redis://host:6379/0", "redis://host:6379/0"),
])
def test_a_password_never_shows_in_the_url_we_print(url, shown):
    """redis-py takes the password in the query too, which went unmasked into logs and /hicache/status."""
    from hicache.storage_redis import redact_url

    assert redact_url(url) == shown


def test_replies_are_parsed_in_c_and_in_chunks_that_do_not_hold_the_loop():
    """A read's MGET reply is parsed on the event loop: with redis-py's Python parser and 32 MiB
    chunks one chunk held the engine's loop 20-25 ms (hiredis and 8 MiB chunks: ~3 ms, measured
    on the CPU machine)."""
    from redis.utils import HIREDIS_AVAILABLE

    from hicache.storage_redis import HEADER, RedisStore

    assert HIREDIS_AVAILABLE
    geometry = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    store = RedisStore(geometry, 64, "redis://127.0.0.1:1/0", model_id="m")  # (connects on first use)
    assert store.pages_per_chunk * (HEADER.size + geometry.bytes_per_page) <= 8 << 20
    store.close()


def test_a_long_outage_backs_off_at_the_cap_without_overflowing():
    """regression: the backoff was lo * 2 ** (failures - 1), uncapped: after ~1,025 connection errors
    in a row (2.3 hours of a dead server at the 8 s cap) the float overflowed inside the error
    handling, and every later request to the store raised OverflowError."""
    import time

    from redis import exceptions as rexc

    from hicache.storage_redis import RedisStore

    store = RedisStore(GEOM, 64, "redis://127.0.0.1:1/0", model_id="m", backoff_s=(0.05, 8.0))  # (no connection)
    store._consecutive_failures = 5000
    err = store._error(rexc.ConnectionError("refused"), "read")
    assert err.kind == "eio" and 7.0 < store._down_until - time.monotonic() <= 8.0
    store.close()

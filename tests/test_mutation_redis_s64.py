"""Rules of the Redis L3 (hicache/storage_redis.py, hicache/redis_limits.py) that session 64's mutation check found
unguarded. Redis tests start `redis-server` on a free loopback port (skipped without the binary)."""
from __future__ import annotations

import asyncio

import pytest
import torch
from redis import exceptions as rexc

from hicache.storage import StorageError
from redis_server import (GEOM, refused_url, needs_redis, private_server, random_pages, redis_server,  # noqa: F401
                          same_bytes, server)
from hicache_helpers import make_manager
from test_redis import make_store

_FIXTURES = (redis_server, server, private_server)  # (the Redis tests' fixtures, found by pytest under these names)
OUTPUT = "client-output-buffer-limit"


def _dead_url() -> str:
    return refused_url()


# ---- arguments ------------------------------------------------------------------------------------------------
def test_a_store_without_a_hint_slot_is_refused():
    """A store needs at least one local L3 slot: 0 is refused at construction, with the number."""
    from hicache.storage_redis import RedisStore
    with pytest.raises(ValueError, match="num_slots must be >= 1, got 0"):
        RedisStore(GEOM, 0, _dead_url(), model_id="test")


@pytest.mark.asyncio
@pytest.mark.parametrize("is_read", [False, True])
async def test_a_host_page_or_slot_one_past_the_end_is_refused_at_once(is_read):
    """A host page equal to the buffer's page count, or a slot equal to the store's slot count, is out of
    range: refused at the call with ValueError (a caller's bug), not sent and failed later as an I/O error."""
    store = make_store(_dead_url())
    host = torch.zeros(GEOM.page_major_shape(2), dtype=GEOM.dtype)
    keys = store.page_keys(list(range(4)), 0, 4)
    call = store.read_pages if is_read else store.write_pages
    try:
        with pytest.raises(ValueError, match="host page out of range"):
            call(host, [2], [0], keys) if not is_read else call([0], host, [2], keys)
        with pytest.raises(ValueError, match="slot out of range"):
            call(host, [0], [64], keys) if not is_read else call([64], host, [0], keys)
    finally:
        await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_chunk_smaller_than_one_value_still_moves_one_page_a_command(server):
    """--chunk_bytes below one page's value: each command carries one page (never zero: no chunks at all)."""
    store = make_store(server.url(), chunk_bytes=1)
    assert store.pages_per_chunk == 1
    src = random_pages(GEOM, 3, seed=5)
    keys = store.page_keys(list(range(12)), 0, 12)
    result = await store.write_pages(src, [0, 1, 2], [0, 1, 2], keys)
    assert result.num_extents == 3
    dst = torch.zeros_like(src)
    await store.read_pages([0, 1, 2], dst, [0, 1, 2], keys)
    assert same_bytes(src, dst) and store.counters["round_trips"] == 6
    await store.aclose()


# ---- loops ------------------------------------------------------------------------------------------------------
@needs_redis
def test_a_store_used_on_a_second_loop_opens_a_client_there(server):
    """A store used on one event loop, then (that loop gone, without release_loop) on another, opens a client
    on the new loop: its reads and writes there succeed rather than fail on the old loop's connections."""
    store = make_store(server.url())
    src = random_pages(GEOM, 2, seed=1)
    keys = store.page_keys(list(range(8)), 0, 8)

    async def write():
        await store.write_pages(src, [0, 1], [0, 1], keys)

    async def read():
        dst = torch.zeros_like(src)
        await store.read_pages([0, 1], dst, [0, 1], keys)
        return dst

    asyncio.run(write())
    dst = asyncio.run(read())
    assert same_bytes(src, dst) and store.errors == {}
    store.close()


# ---- back-off ---------------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_first_connection_failure_backs_off_for_the_first_step():
    """The back-off after one connection failure is its first step (backoff_s[0]), not twice that."""
    store = make_store(_dead_url(), backoff_s=(30.0, 1000.0))
    keys = store.page_keys(list(range(4)), 0, 4)
    with pytest.raises(StorageError, match="eio"):
        await store.write_pages(random_pages(GEOM, 1), [0], [0], keys)
    assert 25.0 < store.stats()["retry_in_s"] <= 30.0
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_an_answer_that_lands_after_a_failure_ends_the_back_off(server):
    """A read in flight when another operation's connection dropped (the store backs off) gets its answer:
    the server is up, so the back-off ends and the next write is sent, not refused as "unavailable"."""
    store = make_store(server.url(), backoff_s=(30.0, 30.0))
    src = random_pages(GEOM, 2, seed=2)
    keys = store.page_keys(list(range(8)), 0, 8)
    await store.write_pages(src, [0, 1], [0, 1], keys)
    client = store._client()
    mget, mset = client.mget, client.mset
    failed = asyncio.Event()

    async def slow_mget(*args, **kw):  # answers after the other operation failed
        await failed.wait()
        return await mget(*args, **kw)

    async def dropped_mset(*args, **kw):
        failed.set()
        raise rexc.ConnectionError("Connection closed by server.")

    client.mget, client.mset = slow_mget, dropped_mset
    read = store.read_pages([0, 1], torch.zeros_like(src), [0, 1], keys)
    await asyncio.sleep(0)
    with pytest.raises(StorageError, match="eio"):
        await store.write_pages(src, [0, 1], [0, 1], keys)
    assert store.stats()["retry_in_s"] > 0
    await read
    client.mset = mset
    assert store.stats()["retry_in_s"] == 0 and store.stats()["available"]
    await store.write_pages(src, [0, 1], [0, 1], keys)
    await store.aclose()


@pytest.mark.asyncio
async def test_a_read_into_one_host_page_twice_is_refused_at_once():
    """Two pages read into one host page (a caller's bug: one would overwrite the other) are refused at the
    call with ValueError, not sent."""
    store = make_store(_dead_url())
    host = torch.zeros(GEOM.page_major_shape(2), dtype=GEOM.dtype)
    keys = store.page_keys(list(range(8)), 0, 8)
    with pytest.raises(ValueError, match="duplicate destination host pages"):
        store.read_pages([0, 1], host, [1, 1], keys)
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_an_injected_enospc_write_fails_enospc(server):
    """The enospc_write fault makes a write fail as a full store ("enospc"), as its name says, not "eio"."""
    from hicache.faults import Fault, FaultInjector
    faults = FaultInjector()
    faults.arm(Fault.ENOSPC_WRITE, times=1)
    store = make_store(server.url(), faults=faults)
    keys = store.page_keys(list(range(4)), 0, 4)
    with pytest.raises(StorageError) as exc:
        await store.write_pages(random_pages(GEOM, 1), [0], [0], keys)
    assert exc.value.kind == "enospc" and store.errors == {"enospc": 1}
    await store.aclose()


# ---- failed reads ---------------------------------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
async def test_a_page_missing_in_a_later_chunk_names_its_own_slot(server):
    """A read in chunks of 2 pages whose 4th page is gone fails "missing" naming that page's slot (13), not
    the slot at the same place in the first chunk: the caller drops the hint of the page that is gone."""
    store = make_store(server.url())
    store.pages_per_chunk = 2
    src = random_pages(GEOM, 4, seed=4)
    keys = store.page_keys(list(range(16)), 0, 16)
    slots = [10, 11, 12, 13]
    await store.write_pages(src, [0, 1, 2, 3], slots, keys)
    server.client().delete(keys[3])
    with pytest.raises(StorageError) as exc:
        await store.read_pages(slots, torch.zeros_like(src), [0, 1, 2, 3], keys)
    assert exc.value.kind == "missing" and exc.value.bad_slots == (13,)
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_read_with_pages_missing_and_corrupt_fails_missing_naming_both(server):
    """One page gone and one corrupt in a read: the read fails "missing" (counted so in the errors by kind),
    naming both slots; the corrupt value is deleted."""
    store = make_store(server.url())
    src = random_pages(GEOM, 3, seed=6)
    keys = store.page_keys(list(range(12)), 0, 12)
    await store.write_pages(src, [0, 1, 2], [0, 1, 2], keys)
    sync = server.client()
    sync.delete(keys[0])
    sync.set(keys[2], b"not a page")
    with pytest.raises(StorageError) as exc:
        await store.read_pages([0, 1, 2], torch.zeros_like(src), [0, 1, 2], keys)
    assert exc.value.kind == "missing" and exc.value.bad_slots == (0, 2)
    assert store.errors == {"missing": 1} and not sync.exists(keys[2])
    assert store.counters["missing_pages"] == 1 and store.counters["corrupt_pages"] == 1
    await store.aclose()


@pytest.mark.asyncio
async def test_a_long_outage_backs_off_at_most_8_s_by_default():
    """By default the store's back-off doubles from 0.25 s up to 8 s: after a long outage it tries the server
    again within 8 s, not later."""
    store = make_store(_dead_url())
    for _ in range(20):
        store._down_until = 0.0  # (each failure after the back-off before it ended: one while backing off
        store._error(rexc.ConnectionError("Connection refused"), "write")  # does not count, test_timers_s74.py)
    assert 7.0 < store.stats()["retry_in_s"] <= 8.0
    await store.aclose()


# ---- hints ------------------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_hint_refresh_while_backing_off_skips_without_a_query_or_an_error():
    """While the store backs off a dead server, a hint refresh counts a skip and returns: no query, no
    error raised to the request, no further error counted."""
    mgr = make_manager(storage_backend="redis", storage_url=_dead_url(), model_id="m")
    store = mgr.store
    store.backoff_s = (30.0, 30.0)
    tokens = tuple(range(300, 316))
    with pytest.raises(StorageError):
        await store.write_pages(random_pages(mgr.geometry, 1), [0], [0], store.page_keys(tokens, 0, 4))
    errors = dict(store.errors)
    await store.refresh_hints(mgr, tokens)
    assert store.counters["hint_skips"] == 1 and store.counters["hint_queries"] == 0 and store.errors == errors
    await mgr.close()


@needs_redis
@pytest.mark.asyncio
async def test_no_hint_query_where_restores_are_off(server):
    """With --hicache-policy never nothing is restored from L3: a hint refresh sends no query."""
    mgr = make_manager(storage_backend="redis", storage_url=server.url(), model_id="m", policy="never")
    store = mgr.store
    tokens = tuple(range(300, 316))
    await store.write_pages(random_pages(mgr.geometry, 4), [0, 1, 2, 3], [0, 1, 2, 3], store.page_keys(tokens, 0, 16))
    await store.refresh_hints(mgr, tokens)
    assert store.counters["hint_queries"] == 0 and store.counters["hint_pages_found"] == 0
    await mgr.close()


@needs_redis
@pytest.mark.asyncio
async def test_a_hint_recheck_over_a_prefix_ending_inside_a_page_checks_its_whole_pages(server):
    """A backup's recheck over 10 hinted tokens (pages of 4) checks the 2 whole pages, rather than failing
    on a key range that ends inside a page."""
    mgr = make_manager(storage_backend="redis", storage_url=server.url(), model_id="m")
    store = mgr.store
    tokens = tuple(range(300, 316))
    await store.write_pages(random_pages(mgr.geometry, 2), [0, 1], [0, 1], store.page_keys(tokens, 0, 8))
    await store.recheck_hints(mgr, tokens, 10)
    assert store.counters["hint_rechecks"] == 1 and store.errors == {}
    await mgr.close()


@needs_redis
@pytest.mark.asyncio
async def test_no_hint_recheck_while_writes_are_refused(server):
    """Where the server's limits refuse every write, a backup's recheck of its hints sends no query: the
    write that would put dropped pages back fails at once anyway."""
    mgr = make_manager(storage_backend="redis", storage_url=server.url(), model_id="m")
    store = mgr.store
    store.refusals._refuse_writes("proto-max-bulk-len", 1 << 20)
    await store.recheck_hints(mgr, tuple(range(300, 316)), 16)
    assert store.counters["hint_rechecks"] == 0
    await mgr.close()


# ---- a restarted server -----------------------------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
async def test_the_first_write_after_a_server_restart_goes_through(private_server):
    """A server restarted between two writes: the second finds its pooled connection closed and is sent once
    more on a fresh one, so it succeeds (no error, no back-off)."""
    store = make_store(private_server.url())
    src = random_pages(GEOM, 1, seed=7)
    keys = store.page_keys(list(range(8)), 0, 8)
    await store.write_pages(src, [0], [0], keys[:1])
    private_server.stop()
    private_server.start()
    await store.write_pages(src, [0], [1], keys[1:])
    assert store.errors == {} and store.stats()["available"]
    assert private_server.client().exists(keys[1]) == 1
    await store.aclose()


# ---- limits ---------------------------------------------------------------------------------------------------
def test_a_query_buffer_limit_must_hold_a_value_and_its_crlf():
    """The server holds a value's bulk and its CRLF whole in the query buffer: a client-query-buffer-limit of
    value + 1 bytes refuses writes, one of value + 2 takes them."""
    from hicache.redis_limits import limits_from_config
    value_bytes = (1 << 20) + 4096
    limits = limits_from_config({"client-query-buffer-limit": str(value_bytes + 1)}, value_bytes)
    assert limits.value_limit == ("client-query-buffer-limit", value_bytes + 1)
    limits = limits_from_config({"client-query-buffer-limit": str(value_bytes + 2)}, value_bytes)
    assert limits.writes_known and limits.value_limit is None


class _Server:
    """A fake store client for `Refusals`: CONFIG GET answers from `config`, PING answers or not."""

    def __init__(self, config: dict | None = None, up: bool = True) -> None:
        self.config, self.up, self.connects, self.config_gets = config or {}, up, 0, 0

    def connect(self) -> "_Server":
        self.connects += 1
        return self

    async def ping(self) -> bool:
        if not self.up:
            raise rexc.ConnectionError("Connection refused")
        return True

    async def config_get(self, name: str) -> dict:
        self.config_gets += 1
        return {name: self.config[name]} if name in self.config else {}


def _refusals(value_bytes: int = 2 << 20, recheck_s: float = 30.0):
    from hicache.redis_limits import Refusals, ServerLimits
    return Refusals("redis://127.0.0.1:1/0", value_bytes, 4, ServerLimits(), recheck_s)


def _reset(cause: BaseException) -> rexc.ConnectionError:
    exc = rexc.ConnectionError("Connection reset by peer")
    exc.__cause__ = cause
    return exc


@pytest.mark.asyncio
@pytest.mark.parametrize("cause", [ConnectionResetError, BrokenPipeError])
async def test_a_large_value_s_write_dropped_by_an_answering_server_refuses_writes(cause):
    """A write of a 2 MiB value whose connection was reset, or whose pipe broke, while the server still
    answers a PING is a value too large: writes are refused, naming proto-max-bulk-len."""
    refusals, server = _refusals(), _Server()
    assert "proto-max-bulk-len" in await refusals.write_failed(server.connect, _reset(cause()))


@pytest.mark.asyncio
async def test_a_large_value_s_write_dropped_by_a_server_that_is_down_is_an_outage():
    """A reset write where the server no longer answers a PING is an outage, not a refusal of the value."""
    refusals = _refusals()
    assert await refusals.write_failed(_Server(up=False).connect, _reset(ConnectionResetError())) is None
    assert refusals.writes is None


@pytest.mark.asyncio
async def test_only_invalid_bulk_length_or_a_reset_refuses_a_large_value():
    """A 2 MiB write failing with another error reply (or at exactly 1 MiB, which every server takes, even
    with "invalid bulk length") refuses nothing."""
    refusals = _refusals()
    assert await refusals.write_failed(_Server().connect, rexc.ResponseError("ERR wrong number of arguments")) is None
    one_mib = _refusals(value_bytes=1 << 20)
    invalid_bulk = rexc.ResponseError("Protocol error: invalid bulk length")
    assert await one_mib.write_failed(_Server().connect, invalid_bulk) is None
    assert await refusals.write_failed(_Server().connect, invalid_bulk)


@pytest.mark.asyncio
async def test_a_write_refused_when_a_recheck_was_due_waits_a_whole_interval_for_its_trial():
    """Writes refused by a failed write (limits unknown) when a recheck was already due: the next write
    still fails at once, with no CONFIG GET and no trial, until a whole interval has passed."""
    refusals, server = _refusals(), _Server()
    refusals._next_check_s = 0.0  # (the interval since the start has passed)
    assert await refusals.write_failed(server.connect, rexc.ResponseError("Protocol error: invalid bulk length"))
    assert await refusals.refused_writes(server.connect) is not None and server.connects == 0


@pytest.mark.asyncio
async def test_limits_still_refusing_are_read_again_once_an_interval():
    """Writes refused by a setting that still refuses: two writes when a recheck is due read the limits
    once (one CONFIG GET round), not once per write."""
    refusals, server = _refusals(), _Server({"proto-max-bulk-len": str(1 << 20)})
    refusals._refuse_writes("proto-max-bulk-len", 1 << 20)
    refusals._next_check_s = 0.0
    assert await refusals.refused_writes(server.connect) is not None
    assert await refusals.refused_writes(server.connect) is not None
    assert server.connects == 1


@pytest.mark.asyncio
async def test_only_a_dropped_read_connection_reads_the_limits_again():
    """A read that failed with an error reply (not a dropped connection) does not read the limits again,
    even where a recheck is due; a dropped one does."""
    refusals, server = _refusals(recheck_s=0.0), _Server({OUTPUT: "normal 0 0 0"})
    assert await refusals.read_failed(server.connect, rexc.ResponseError("WRONGTYPE")) is None
    assert server.connects == 0
    await refusals.read_failed(server.connect, rexc.ConnectionError("Connection closed by server."))
    assert server.connects == 1



def test_an_output_buffer_limit_sizes_read_chunks_with_the_allocator_s_rounding_and_slack():
    """MGET chunks under `client-output-buffer-limit normal <hard>`: each 100 kB value costs its size, a quarter
    more (jemalloc's rounding) and 64 bytes of framing, and 16 KiB stay free: 1 byte short of room for 10
    values gives chunks of 9."""
    from hicache.redis_limits import Refusals, ServerLimits
    value_bytes = 100_000
    hard = (16 << 10) + 10 * (value_bytes + value_bytes // 4 + 64)
    assert Refusals("redis://h:1/0", value_bytes, 4, ServerLimits(output_limit_bytes=hard)).reply_pages == 10
    assert Refusals("redis://h:1/0", value_bytes, 4, ServerLimits(output_limit_bytes=hard - 1)).reply_pages == 9


def test_refused_limits_are_read_again_every_30_s_by_default():
    """As the module docstrings say: a refusal's limits are read again at most every 30 s by default."""
    from hicache.redis_limits import Refusals, ServerLimits
    assert Refusals("redis://h:1/0", 1000, 4, ServerLimits()).recheck_s == 30.0

"""Rules of the Redis L3 (hicache/storage_redis.py, hicache/redis_limits.py, hicache/redis_values.py) that
session 69's mutation check found unguarded: the store's argument checks, its key names, the 1,024-page chunk cap,
the socket timeout a command waits, faults firing only in their own direction, which answers end a run of
failures, hint queries that time out, the EXISTS fallback where scripting is refused, the LRU refresh of hinted
pages, and the value header's byte layout. Redis tests start `redis-server` on a free loopback port (skipped
without the binary); a hung server is an asyncio socket that never answers."""
from __future__ import annotations

import asyncio
import re

import pytest
import torch
from redis import exceptions as rexc

from hicache.radix import Tier
from hicache.storage import StorageError
from hicache_helpers import capture_op_logs, make_manager, write_prefix
from redis_server import (GEOM, free_port, needs_redis, private_server, random_pages, redis_server,  # noqa: F401
                          refused_url, same_bytes, server)
from test_mutation_redis_s64 import _refusals, _Server
from test_redis import make_store

_FIXTURES = (redis_server, server, private_server)  # (the Redis tests' fixtures, found by pytest under these names)


def _keys(store, num_pages: int, first: int = 0) -> list[bytes]:
    tokens = list(range(first, first + 4 * num_pages))
    return store.page_keys(tokens, 0, len(tokens))


async def _drop_next_mset(store) -> None:
    """The store's next MSET finds its connection dropped (once)."""
    client = store._client()
    mset = client.mset

    async def dropped(*args, **kw):
        client.mset = mset
        raise rexc.ConnectionError("Connection closed by server.")

    client.mset = dropped


# ---- arguments --------------------------------------------------------------------------------------------------
def test_an_empty_url_is_refused_naming_the_flag():
    """An empty --hicache-storage-url is refused with the message naming the flag, not the client's parse error."""
    from hicache.storage_redis import RedisStore
    with pytest.raises(ValueError, match="needs a URL"):
        RedisStore(GEOM, 64, "", model_id="test")


@pytest.mark.asyncio
@pytest.mark.parametrize("call, says", [
    ("keys", "1 host pages, 1 slots and 2 keys"),
    ("negative host page", "host page out of range"),
    ("negative slot", "slot out of range"),
    ("other page size", "host_buffer holds"),
    ("not contiguous", "contiguous CPU tensor"),
])
async def test_a_malformed_operation_is_refused_at_the_call(call, says):
    """A caller's bug is refused at the call with ValueError, never sent: keys not one per page, a negative host
    page or slot (numpy would take -1 as the last page), a buffer of pages of another size, or a buffer that is
    not contiguous (its pages would not be where the view says)."""
    store = make_store(refused_url())
    host = torch.zeros(GEOM.page_major_shape(2), dtype=GEOM.dtype)
    keys = _keys(store, 2)
    args = {"keys": (host, [0], [0], keys), "negative host page": (host, [-1], [0], keys[:1]),
            "negative slot": (host, [0], [-1], keys[:1]),
            "other page size": (torch.zeros(2, GEOM.bytes_per_page + 4, dtype=torch.uint8), [0], [0], keys[:1]),
            "not contiguous": (torch.zeros(2, 2 * GEOM.bytes_per_page, dtype=torch.uint8)[:, ::2], [0], [0],
                               keys[:1])}[call]
    buffer, host_pages, slots, op_keys = args
    try:
        for is_read in (False, True):
            with pytest.raises(ValueError, match=re.escape(says)):
                if is_read:
                    store.read_pages(slots, buffer, host_pages, op_keys)
                else:
                    store.write_pages(buffer, host_pages, slots, op_keys)
        assert store.counters["round_trips"] == 0 and store.errors == {}
    finally:
        await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_write_may_store_one_host_page_under_two_keys(server):
    """Only reads refuse a host page named twice (two pages landing in one); a write may send one page under
    two keys."""
    store = make_store(server.url())
    src = random_pages(GEOM, 1, seed=3)
    keys = _keys(store, 2)
    await store.write_pages(src, [0, 0], [0, 1], keys)
    dst = torch.zeros(GEOM.page_major_shape(2), dtype=GEOM.dtype)
    await store.read_pages([0, 1], dst, [0, 1], keys)
    assert same_bytes(dst[0], src[0]) and same_bytes(dst[1], src[0])
    await store.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("is_read", [False, True])
async def test_an_empty_operation_resolves_at_once_even_while_backing_off(is_read):
    """An operation of no pages resolves to an empty IoResult without touching the server: not counted as an
    operation, and not failed by a back-off from an earlier failure."""
    store = make_store(refused_url(), backoff_s=(30.0, 30.0))
    with pytest.raises(StorageError):
        await store.write_pages(random_pages(GEOM, 1), [0], [0], _keys(store, 1))
    host = torch.zeros(GEOM.page_major_shape(1), dtype=GEOM.dtype)
    result = await (store.read_pages([], host, [], []) if is_read else store.write_pages(host, [], [], []))
    assert result.num_bytes == 0 and result.num_extents == 0
    assert store.counters["writes"] == store.counters["reads"] == 0 and store.errors == {"eio": 1}
    await store.aclose()


# ---- keys and chunks --------------------------------------------------------------------------------------------
def test_a_page_s_key_is_the_prefix_and_the_lower_case_hex_of_its_chained_hash():
    """A page's key is `hicache:kv:` and the lower-case hex of its chained hash: every instance (and any tool
    scanning `hicache:kv:*`) must name a page alike, so the spelling of the hex is part of the format."""
    from hicache.page_keys import page_keys
    store = make_store(refused_url())
    tokens = list(range(12))
    digests = page_keys(store.salt, tokens, 0, 12, GEOM.page_size)
    assert store.page_keys(tokens, 0, 12) == [b"hicache:kv:" + d.hex().encode() for d in digests]
    assert all(re.fullmatch(rb"hicache:kv:[0-9a-f]+", k) for k in store.page_keys(tokens, 0, 12))
    store.close()


@needs_redis
@pytest.mark.asyncio
async def test_a_command_carries_at_most_1024_pages(server):
    """However many small pages fit in --chunk_bytes (8 MiB holds 2,036 of these 4 KiB pages), one MSET or MGET
    carries at most 1,024: 1,030 pages move in 2 commands each way."""
    store = make_store(server.url())
    n = 1030
    src = random_pages(GEOM, n, seed=9)
    keys = _keys(store, n)
    written = await store.write_pages(src, range(n), [i % 64 for i in range(n)], keys)
    dst = torch.zeros_like(src)
    read = await store.read_pages([i % 64 for i in range(n)], dst, range(n), keys)
    assert written.num_extents == read.num_extents == 2 and same_bytes(src, dst)
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_roomy_output_buffer_limit_does_not_lengthen_read_chunks(private_server):
    """An output buffer limit only shortens MGET chunks: a limit with room for 20 pages leaves reads in the
    chunks --chunk_bytes asks for (2 pages here), not longer ones."""
    sync = private_server.client()
    store = make_store(private_server.url())
    value_cost = store.value_bytes + store.value_bytes // 4 + 64
    sync.config_set("client-output-buffer-limit", f"normal {(16 << 10) + 20 * value_cost} 0 0")
    await store.aclose()
    store = make_store(private_server.url(), chunk_bytes=2 * store.value_bytes)
    assert store.refusals.reply_pages == 20 and store.pages_per_chunk == 2
    src = random_pages(GEOM, 6, seed=2)
    keys = _keys(store, 6)
    await store.write_pages(src, range(6), range(6), keys)
    result = await store.read_pages(range(6), torch.zeros_like(src), range(6), keys)
    assert result.num_extents == 3
    await store.aclose()


# ---- faults -------------------------------------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
async def test_io_faults_fire_only_in_their_own_direction(server):
    """eio_read fails the next read, not a write sent before it; eio_write the next write, not a read."""
    from hicache.faults import Fault, FaultInjector
    faults = FaultInjector()
    store = make_store(server.url(), faults=faults)
    src = random_pages(GEOM, 1, seed=4)
    keys = _keys(store, 1)
    faults.arm(Fault.EIO_READ, times=1)
    await store.write_pages(src, [0], [0], keys)
    with pytest.raises(StorageError, match="injected eio_read"):
        await store.read_pages([0], torch.zeros_like(src), [0], keys)
    faults.arm(Fault.EIO_WRITE, times=1)
    await store.read_pages([0], torch.zeros_like(src), [0], keys)
    with pytest.raises(StorageError, match="injected eio_write"):
        await store.write_pages(src, [0], [0], keys)
    await store.aclose()


# ---- a hung server --------------------------------------------------------------------------------------------
class _Hung:
    """A port that accepts connections and never answers (a stopped or swapping server)."""

    def __init__(self) -> None:
        self.port, self.writers, self.server = free_port(), [], None

    async def __aenter__(self) -> "_Hung":
        async def never_answer(reader, writer):
            self.writers.append(writer)
            await reader.read()

        self.server = await asyncio.start_server(never_answer, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc) -> None:
        for writer in self.writers:
            writer.close()
        self.server.close()


@pytest.mark.asyncio
async def test_a_command_waits_the_socket_timeout_not_the_connect_timeout():
    """A command on a hung server fails once --socket_timeout_s (0.2 s) passed, whatever the connect timeout
    (60 s here, far over the guard): the two timeouts are not mixed up."""
    hung = _Hung()
    store = make_store(f"redis://127.0.0.1:{hung.port}/0", socket_timeout_s=0.2, connect_timeout_s=60.0)
    async with hung:
        with pytest.raises(StorageError) as exc:
            await asyncio.wait_for(store.write_pages(random_pages(GEOM, 1), [0], [0], _keys(store, 1)), 20.0)
        assert exc.value.kind == "eio" and "Timeout" in str(exc.value)
    await store.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["refresh", "recheck"])
async def test_a_hint_query_past_its_timeout_is_an_error_that_backs_off(what):
    """A hint refresh or a backup's recheck whose existence query outlives --hint_timeout_s counts an "eio" and
    backs off (later queries skip a hung server); the refresh fails (the request goes on without L3 hints), the
    recheck keeps the hints (its write will tell)."""
    hung = _Hung()
    mgr = make_manager(storage_backend="redis", storage_url=f"redis://127.0.0.1:{hung.port}/0", model_id="m")
    store = mgr.store
    store.hint_timeout_s = 0.1
    tokens = tuple(range(300, 316))
    async with hung:
        if what == "refresh":
            with pytest.raises(StorageError) as exc:
                await store.refresh_hints(mgr, tokens)
            assert exc.value.kind == "eio"
        else:
            await store.recheck_hints(mgr, tokens, 8)
        assert store.errors == {"eio": 1} and store.stats()["retry_in_s"] > 0
    await mgr.close()


# ---- the end of a run of failures -----------------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("answer", ["write", "hint refresh", "hint recheck", "suspect delete"])
async def test_any_answer_from_the_server_ends_a_run_of_failures(server, answer):
    """After a dropped connection, any answer from the server (a write, a hint query, a backup's recheck, a
    suspect delete) ends the run of failures: the store says it is available again, and the next failure backs
    off for the first step again, not a doubled one."""
    mgr = make_manager(storage_backend="redis", storage_url=server.url(), model_id="m")
    store = mgr.store
    store.backoff_s = (0.0, 0.0)  # (the back-off of the first failure is over at once)
    tokens = tuple(range(300, 316))
    keys = store.page_keys(tokens, 0, 16)
    src = random_pages(mgr.geometry, 4, seed=1)
    await _drop_next_mset(store)
    with pytest.raises(StorageError):
        await store.write_pages(src, range(4), range(4), keys)
    assert not store.stats()["available"]
    if answer == "write":
        await store.write_pages(src, range(4), range(4), keys)
    elif answer == "hint refresh":
        await store.refresh_hints(mgr, tokens)
    elif answer == "hint recheck":
        await store.recheck_hints(mgr, tokens, 16)
    else:
        store.delete_suspect(keys)
        await store.settle_deletes()
    assert store.stats()["available"]
    store.backoff_s = (30.0, 1000.0)
    await _drop_next_mset(store)
    with pytest.raises(StorageError):
        await store.write_pages(src, range(4), range(4), keys)
    assert 25.0 < store.stats()["retry_in_s"] <= 30.0
    await mgr.close()


# ---- refused reads ----------------------------------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
async def test_a_read_the_output_buffer_limit_refuses_names_every_slot(private_server):
    """Where the server cannot send one page back (its output buffer limit), a read fails at once naming every
    slot it was asked for, so the caller drops those hints rather than asking again."""
    private_server.client().config_set("client-output-buffer-limit", "normal 16000 0 0")
    store = make_store(private_server.url())
    keys = _keys(store, 2)
    with pytest.raises(StorageError) as exc:
        await store.read_pages([7, 5], torch.zeros(GEOM.page_major_shape(2), dtype=GEOM.dtype), [0, 1], keys)
    assert exc.value.kind == "eio" and sorted(exc.value.bad_slots) == [5, 7]
    await store.aclose()


# ---- hints ------------------------------------------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
async def test_a_prompt_l2_holds_whole_asks_redis_nothing(server):
    """A prompt whose every full page is in L2 (not L1) needs nothing from L3: no hint query."""
    mgr = make_manager(storage_backend="redis", storage_url=server.url(), model_id="m")
    store = mgr.store
    tokens = tuple(range(300, 316))
    write_prefix(mgr, tokens)
    await mgr.drain()
    mgr.flush(Tier.L1)
    local = mgr.tree.match(tokens, include_storage=False, touch=False)
    assert local.lengths[Tier.L1] == 0 and local.lengths[Tier.L2] == 16
    queries = store.counters["hint_queries"]
    await store.refresh_hints(mgr, tokens)
    assert store.counters["hint_queries"] == queries and store.counters["hints_not_needed"] == 1
    await mgr.close()


@needs_redis
@pytest.mark.asyncio
async def test_a_hint_query_refreshes_the_pages_eviction_age(private_server):
    """The hint query TOUCHes the pages it finds (a read is likely to follow): under allkeys-lfu each found
    page's access count goes up, so Redis keeps the pages other instances are about to read."""
    sync = private_server.client()
    sync.config_set("maxmemory-policy", "allkeys-lfu")
    sync.config_set("lfu-log-factor", 0)  # (each access counts)
    store = make_store(private_server.url())
    keys = _keys(store, 3)
    await store.write_pages(random_pages(GEOM, 3), range(3), range(3), keys)
    before = [sync.object("freq", k) for k in keys]
    assert await store.count_present(keys) == 3
    assert all(after > was for after, was in zip([sync.object("freq", k) for k in keys], before))
    await store.aclose()


APP_NO_SCRIPTS = ("ACL", "SETUSER", "noscripts", "reset", "on", ">pw", "~hicache:*", "+@all", "-@dangerous",
                  "-@scripting")


@needs_redis
@pytest.mark.asyncio
async def test_where_scripting_is_refused_hints_use_exists_and_say_so_once(server):
    """A user that may not run scripts: hint queries fall back to EXISTS (every page present counts them all,
    a gap stops the count), with one "l3_redis_no_scripting" warning, not one per query."""
    sync = server.client()
    sync.execute_command(*APP_NO_SCRIPTS)
    try:
        store = make_store(f"redis://noscripts:pw@127.0.0.1:{server.port}/0")
        keys = _keys(store, 3)
        await store.write_pages(random_pages(GEOM, 3), range(3), range(3), keys)
        with capture_op_logs() as logs:
            assert await store.count_present(keys) == 3
            sync.delete(keys[1])
            assert await store.count_present(keys) == 1
        assert [e["event"] for e in logs].count("l3_redis_no_scripting") == 1
        await store.aclose()
    finally:
        sync.execute_command("ACL", "DELUSER", "noscripts")


@needs_redis
def test_a_new_loop_s_client_tries_the_hint_script_again(server):
    """Scripting refused on one loop's client (an ACL since changed) does not stick to the store: the client of
    the next loop (`Engine.generate` runs each call on a fresh loop) tries the script again."""
    sync = server.client()
    sync.execute_command(*APP_NO_SCRIPTS)

    async def count_on_a_loop_of_its_own(keys) -> int:
        try:
            return await store.count_present(keys)
        finally:
            await store.release_loop()  # (as Engine.generate's loop ends: its client closed)
    try:
        store = make_store(f"redis://noscripts:pw@127.0.0.1:{server.port}/0")
        keys = _keys(store, 2)
        assert asyncio.run(count_on_a_loop_of_its_own(keys)) == 0
        assert not store._script_ok
        sync.execute_command("ACL", "SETUSER", "noscripts", "+@scripting")
        calls = sync.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        assert asyncio.run(count_on_a_loop_of_its_own(keys)) == 0
        assert sync.info("commandstats")["cmdstat_evalsha"]["calls"] > calls
        store.close()
    finally:
        sync.execute_command("ACL", "DELUSER", "noscripts")


# ---- suspect pages ----------------------------------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
async def test_suspect_pages_deleted_counts_the_pages_that_were_there(server):
    """`suspect_pages_deleted` counts the pages the delete removed (2 of the 3 asked for here: one was gone)."""
    store = make_store(server.url())
    keys = _keys(store, 3)
    await store.write_pages(random_pages(GEOM, 2), [0, 1], [0, 1], keys[:2])
    store.delete_suspect(keys)
    await store.settle_deletes()
    assert store.counters["suspect_pages_deleted"] == 2 and server.client().exists(*keys) == 0
    await store.aclose()


# ---- the stored value's format ------------------------------------------------------------------------------
def test_a_stored_value_s_header_has_the_documented_layout():
    """The 24-byte header every instance reads and writes: b"HKV2", the payload's length (u32), xxh3_64 of the
    key, xxh3_64 of the payload (u64s), little-endian. A golden value: another layout (byte order, field widths,
    hash) would make every page other instances wrote unreadable ("checksum") after an upgrade."""
    from hicache.redis_values import HEADER, check_value, pack_value
    value = pack_value(memoryview(bytes(range(16))), b"hicache:kv:00")
    assert HEADER.size == 24 and value[24:] == bytes(range(16))
    assert value[:24].hex() == "484b5632" "10000000" "7c6a3caa12c96d2e" "db7017f6a6e35583"
    assert check_value(value, b"hicache:kv:00", 16, True) is None


@needs_redis
@pytest.mark.asyncio
async def test_a_closed_store_deletes_nothing(server):
    """A suspect delete asked of a closed store sends nothing (a closed store opens no new client)."""
    store = make_store(server.url())
    keys = _keys(store, 2)
    await store.write_pages(random_pages(GEOM, 2), [0, 1], [0, 1], keys)
    await store.aclose()
    store.delete_suspect(keys)
    await store.settle_deletes()
    assert store.stats()["in_flight"] == 0 and server.client().exists(*keys) == 2


# ---- lifecycle ----------------------------------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
async def test_releasing_a_loop_finishes_its_writes_before_closing_the_client(server):
    """release_loop (the loop is about to end) lets a write in flight finish, then closes the client."""
    store = make_store(server.url())
    src = random_pages(GEOM, 2, seed=8)
    keys = _keys(store, 2)
    await store.write_pages(src, [0, 1], [0, 1], keys)  # (the loop's client is open)
    write = store.write_pages(src, [0, 1], [2, 3], keys)
    await store.release_loop()
    assert write.done() and write.exception() is None and store._redis is None
    assert store.counters["writes"] == 2 and store.errors == {}
    await store.aclose()


# ---- limits -------------------------------------------------------------------------------------------------
def test_a_value_over_both_input_limits_names_the_bulk_limit():
    """A value over both proto-max-bulk-len and client-query-buffer-limit: the refusal names the bulk limit
    (the one the server checks first)."""
    from hicache.redis_limits import limits_from_config
    value_bytes = 2 << 20
    limits = limits_from_config({"proto-max-bulk-len": str(1 << 20), "client-query-buffer-limit": str(1 << 20)},
                                value_bytes)
    assert limits.value_limit == ("proto-max-bulk-len", 1 << 20)


def test_an_output_limit_answer_without_a_hard_limit_is_not_known():
    """A look-alike server's `client-output-buffer-limit` answer that ends at "normal" (no hard limit after it)
    says nothing of replies: no limit known, not a crash."""
    from hicache.redis_limits import limits_from_config
    assert limits_from_config({"client-output-buffer-limit": "normal"}, 1000).output_limit_bytes is None
    assert limits_from_config({"client-output-buffer-limit": "normal 5000 0 0"}, 1000).output_limit_bytes == 5000


class _SlowServer(_Server):
    """A fake store client whose CONFIG GET answers once `answer` is set (never, where it is not)."""

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(config)
        self.answer, self.asked = asyncio.Event(), 0

    async def config_get(self, name: str) -> dict:
        self.asked += 1
        await self.answer.wait()
        return await super().config_get(name)


@pytest.mark.asyncio
async def test_writes_refused_meanwhile_wait_for_one_recheck_not_one_each():
    """Two writes refused while one read of the limits is in flight: the second does not read them again
    beside it (one CONFIG GET round a recheck interval, even when they overlap)."""
    refusals, server = _refusals(), _SlowServer({"proto-max-bulk-len": str(1 << 20)})
    refusals._refuse_writes("proto-max-bulk-len", 1 << 20)
    refusals._next_check_s = 0.0
    first = asyncio.ensure_future(refusals.refused_writes(server.connect))
    for _ in range(100):  # (until the first waits for its CONFIG GET: a bounded count of loop turns)
        if server.asked:
            break
        await asyncio.sleep(0)
    assert server.asked == 1
    assert await refusals.refused_writes(server.connect) is not None
    server.answer.set()
    assert await first is not None and server.connects == 1


@pytest.mark.asyncio
async def test_a_read_of_the_limits_that_never_answers_gives_up_after_its_timeout():
    """A recheck of the limits on a server that never answers gives up after the store's hint timeout: the
    refused write fails (its refusal stands) rather than waiting on the server for good."""
    from hicache.redis_limits import Refusals, ServerLimits
    refusals = Refusals("redis://127.0.0.1:1/0", 2 << 20, 4, ServerLimits(), 30.0, timeout_s=0.05)
    refusals._refuse_writes("proto-max-bulk-len", 1 << 20)
    refusals._next_check_s = 0.0
    assert await asyncio.wait_for(refusals.refused_writes(_SlowServer().connect), 20.0) is not None

"""The Redis L3's fault paths that no test ran (session 72 coverage hunt): an operation queued before a close
fails "closed" (it never opens a new client), a buffer that is no tensor is a TypeError, an injected slow read
still reads the right bytes, a corrupt page whose DEL the server refuses (an ACL) still fails the read as
"checksum" with its slot, a backup's hint recheck against a server that is down keeps the hints, and the
write-refusal rules: a write failing beside a refused one keeps the first reason (no second warning, no PING),
and a timeout or a refused connection is an outage, not a value too large."""
from __future__ import annotations

import pytest
import torch
from redis import exceptions as rexc
from structlog.testing import capture_logs

from hicache.faults import Fault, FaultInjector
from hicache.page_keys import publish_l3_hints
from hicache.radix import Tier
from hicache.storage import StorageError
from hicache_helpers import assert_whole, make_manager
from redis_server import (GEOM, needs_redis, private_server, random_pages, redis_server, refused_url,  # noqa: F401
                          same_bytes, server)
from test_mutation_redis_s64 import _refusals, _reset, _Server
from test_redis import make_store

_FIXTURES = (redis_server, server, private_server)  # (the Redis tests' fixtures, found by pytest under these names)


@pytest.mark.asyncio
@pytest.mark.parametrize("is_read", [False, True])
async def test_an_operation_queued_before_a_close_fails_closed(is_read):
    """An operation submitted, then the store closed before it ran (the engine shutting down): it fails
    StorageError "closed" and opens no client (not an "eio" from a connection tried after the close)."""
    store = make_store(refused_url())
    buf = random_pages(GEOM, 1)
    keys = store.page_keys(list(range(4)), 0, 4)
    task = store.read_pages([0], buf, [0], keys) if is_read else store.write_pages(buf, [0], [0], keys)
    store.close()
    with pytest.raises(StorageError) as exc:
        await task
    assert exc.value.kind == "closed" and store._redis is None and store.errors == {}


@pytest.mark.asyncio
async def test_a_host_buffer_that_is_no_tensor_is_a_type_error():
    store = make_store(refused_url())
    keys = store.page_keys(list(range(4)), 0, 4)
    with pytest.raises(TypeError, match="host_buffer must be a torch.Tensor, got list"):
        store.write_pages([0.0] * 8, [0], [0], keys)
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_slow_read_fault_delays_the_read_and_it_still_reads_the_pages(server):
    faults = FaultInjector()
    store = make_store(server.url(), faults=faults)
    src = random_pages(GEOM, 2, seed=4)
    keys = store.page_keys(list(range(8)), 0, 8)
    await store.write_pages(src, [0, 1], [0, 1], keys)
    faults.arm(Fault.SLOW_READ, times=1, delay_s=0.05)
    dst = torch.zeros_like(src)
    result = await store.read_pages([0, 1], dst, [0, 1], keys)
    assert faults.fired[Fault.SLOW_READ] == 1 and same_bytes(src, dst)
    assert result.queue_wait_ns >= 40_000_000  # (the delay comes before the first round trip: a lower bound)
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_a_corrupt_page_whose_delete_is_refused_still_fails_the_read_as_checksum(private_server):
    """The server refuses DEL (an ACL): deleting the corrupt value is best effort, so the read fails as it would
    have ("checksum", the slot named, counted), not with the DEL's NOPERM error; the value stays."""
    store = make_store(private_server.url())
    src = random_pages(GEOM, 3)
    keys = store.page_keys(list(range(12)), 0, 12)
    await store.write_pages(src, [0, 1, 2], [5, 6, 7], keys)
    sync = private_server.client()
    sync.set(keys[1], b"not a page")
    sync.execute_command("ACL", "SETUSER", "default", "-del")
    with pytest.raises(StorageError) as exc:
        await store.read_pages([5, 6, 7], torch.zeros_like(src), [0, 1, 2], keys)
    assert exc.value.kind == "checksum" and exc.value.bad_slots == (6,)
    assert store.counters["corrupt_pages"] == 1 and store.errors == {"checksum": 1}
    assert sync.get(keys[1]) == b"not a page"
    await store.aclose()


@pytest.mark.asyncio
async def test_a_hint_recheck_against_a_server_that_is_down_keeps_the_hints():
    """A backup's recheck whose existence query fails (the server down) leaves the hints as they are (the write
    that follows tells), counts one "eio" and raises nothing into the backup."""
    mgr = make_manager(storage_backend="redis", storage_url=refused_url(), model_id="m")
    store = mgr.store
    tokens = tuple(range(300, 316))
    assert publish_l3_hints(mgr, tokens, 16)[0] == 4
    await store.recheck_hints(mgr, tokens, 16)
    assert store.counters["hint_rechecks"] == 1 and store.errors == {"eio": 1}
    assert mgr.tree.match(tokens, touch=False).lengths[Tier.L3] == 16
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("failure", ["invalid bulk", "reset"])
async def test_a_write_failing_beside_a_refused_one_keeps_its_reason(failure):
    """Writes refused by a setting (client-query-buffer-limit) while a write sent beside them was in flight: that
    write's failure keeps the reason as it is (no second warning naming another setting, no PING sent)."""
    refusals, server = _refusals(), _Server()
    refusals._refuse_writes("client-query-buffer-limit", 1 << 20)
    reason, next_check = refusals.writes, refusals._next_check_s
    exc = (rexc.ResponseError("Protocol error: invalid bulk length") if failure == "invalid bulk"
           else _reset(ConnectionResetError()))
    with capture_logs() as logs:
        assert await refusals.write_failed(server.connect, exc) == reason
    assert logs == [] and server.connects == 0 and refusals._next_check_s == next_check
    assert "client-query-buffer-limit of 1048576 bytes" in reason


@pytest.mark.asyncio
@pytest.mark.parametrize("exc", [rexc.TimeoutError("Timeout reading from socket"),
                                 rexc.ConnectionError("Connection refused")], ids=["timeout", "refused"])
async def test_a_large_value_s_write_that_timed_out_or_found_no_server_is_an_outage(exc):
    """A 2 MiB write failing by a timeout, or a connection error that is no reset while sending: an outage, not a
    value too large (writes stay allowed, no PING)."""
    refusals, server = _refusals(), _Server()
    assert await refusals.write_failed(server.connect, exc) is None
    assert refusals.writes is None and server.connects == 0


@pytest.mark.asyncio
async def test_stale_hints_that_a_reader_holds_are_kept_until_it_lets_go():
    """The shared store lost a hinted prefix's last pages while a read holds them locked in L3: the refresh
    drops nothing then (that read fails and drops them itself) and raises nothing; once the lock goes, the
    next refresh drops them."""
    mgr = make_manager(storage_backend="redis", storage_url=refused_url(), model_id="m")
    tokens = tuple(range(300, 316))
    assert publish_l3_hints(mgr, tokens, 16) == (4, 0)
    handle = mgr.tree.match(tokens, touch=False).handles[Tier.L3]
    mgr.lock(handle, Tier.L3)
    assert publish_l3_hints(mgr, tokens, 8) == (0, 0)
    assert mgr.tree.match(tokens, touch=False).lengths[Tier.L3] == 16
    mgr.unlock(handle, Tier.L3)
    assert publish_l3_hints(mgr, tokens, 8) == (0, 2)
    assert mgr.tree.match(tokens, touch=False).lengths[Tier.L3] == 8
    assert_whole(mgr)
    await mgr.close()

"""Rules of the L3 tier that session 56's mutation check of hicache/storage*.py, l3_index.py, page_keys.py,
redis_limits.py and storage_redis.py found unguarded: the file store's ENOSPC back-off counted once per failed
write and bounded for a disk full for days, a failed read naming every page it lost, a restart on a full disk
reusing its own file's blocks, misaligned key ranges refused, a small hint table filled as far as it goes, the
Redis limits' boundaries, and a suspect delete never sent to a server the store backs off (its damaged index
entries are in tests/test_l3_persist.py). Redis tests start `redis-server` on a free loopback port (skipped
without the binary)."""
from __future__ import annotations

import asyncio
import errno
import os

import pytest
import torch
from redis import exceptions as rexc

from hicache.faults import Fault, FaultInjector
from hicache.page_keys import PageKeyer, kv_salt, page_keys
from hicache.radix import Tier
from hicache.redis_limits import Refusals, ServerLimits, limits_from_config
from hicache.storage import FileStore, StorageError
from hicache_helpers import assert_whole, make_manager
from redis_server import GEOM, refused_url, needs_redis, random_pages, redis_server, server  # noqa: F401
from test_l3_reserve_hunt import NUM_SLOTS, SMALL, _Clock, _enospc_pwritev
from test_redis import make_store

_FIXTURES = (redis_server, server)  # (the Redis tests' fixtures, found by pytest under these names)


# ---- the file store: ENOSPC back-off -------------------------------------------------------------------
def test_one_write_failing_enospc_in_two_io_tasks_backs_off_once(tmp_path, monkeypatch):
    """A write split over two I/O tasks (two extents) that both hit a full disk is one ENOSPC: writes pause
    for the first step of the back-off (1 s), not a doubled one, and one back-off is counted."""
    store = FileStore(SMALL, NUM_SLOTS, path=tmp_path / "l3.kv", io_workers=2)
    store.clock = _Clock()
    host = torch.ones(2, store.bytes_per_page, dtype=torch.uint8)
    calls: list = []
    monkeypatch.setattr(os, "pwritev", _enospc_pwritev(calls))
    with pytest.raises(StorageError, match="enospc"):
        store.write_pages(host, [0, 1], [0, 2]).result(timeout=10)  # slots 0 and 2: two extents, two tasks
    assert len(calls) == 2  # both tasks reached the disk
    assert store.stats()["enospc_backoffs"] == 1
    assert store.write_retry_in_s() == 1.0
    store.close()


def test_a_disk_full_for_days_keeps_backing_off_at_the_cap(tmp_path, monkeypatch):
    """After over a thousand ENOSPC writes in a row (a disk full for days at the 60 s cap) every write still
    fails as a clean "enospc" with the back-off at its cap: the doubling's exponent must not overflow the
    float inside the error handling (the write's future would then never resolve)."""
    store = FileStore(SMALL, 8, path=tmp_path / "l3.kv", enospc_backoff_s=(1.0, 60.0))
    clock = store.clock = _Clock()
    host = torch.ones(1, store.bytes_per_page, dtype=torch.uint8)
    monkeypatch.setattr(os, "pwritev", _enospc_pwritev([]))
    for _ in range(1030):
        clock.now_s += 61.0  # past each back-off: the write is tried and fails again
        with pytest.raises(StorageError, match="enospc"):
            store.write_pages(host, [0], [0]).result(timeout=5)
    assert store.stats()["enospc_backoffs"] == 1030
    assert store.write_retry_in_s() == 60.0
    store.close()


# ---- the file store: a read that fails in two tasks ------------------------------------------------------
def test_a_read_failing_in_two_io_tasks_names_every_page_it_lost():
    """A read of two extents whose two I/O tasks both fail (EIO) names the slots of both in its error, so
    the caller drops every one of them from L3 rather than reading the others again and failing again."""
    faults = FaultInjector()
    with FileStore(SMALL, 16, io_workers=2, faults=faults) as store:
        host = torch.arange(4 * store.bytes_per_page, dtype=torch.int64).to(torch.uint8).reshape(4, -1)
        store.write_pages(host, [0, 1, 2, 3], [0, 1, 5, 6]).result(timeout=10)
        faults.arm(Fault.EIO_READ, times=None)
        with pytest.raises(StorageError) as exc:
            store.read_pages([0, 1, 5, 6], torch.zeros_like(host), [0, 1, 2, 3]).result(timeout=10)
        assert exc.value.kind == "eio"
        assert sorted(exc.value.bad_slots) == [0, 1, 5, 6]


# ---- the file: a restart on a full disk -------------------------------------------------------------------
def test_a_store_reopened_on_a_full_disk_reuses_its_own_file_s_blocks(tmp_path, monkeypatch):
    """A store reopened on its path after its disk filled up: the file's own blocks are reused, so the
    free-space check counts them and the store opens (rather than refusing a restart for want of space it
    already holds)."""
    path = tmp_path / "l3.kv"
    FileStore(SMALL, NUM_SLOTS, path=path).close()
    if os.stat(path).st_blocks * 512 < NUM_SLOTS * SMALL.bytes_per_page:
        pytest.skip("this file system did not reserve the file's blocks")
    real = os.fstatvfs

    class _Full:
        def __init__(self, st) -> None:
            self.f_frsize, self.f_bavail = st.f_frsize, 0  # not a free block left

    monkeypatch.setattr(os, "fstatvfs", lambda fd: _Full(real(fd)))
    with FileStore(SMALL, NUM_SLOTS, path=path) as store:
        assert store.size_bytes == NUM_SLOTS * SMALL.bytes_per_page
    with pytest.raises(ValueError, match="available"):  # (a larger one does not fit)
        FileStore(SMALL, 2 * NUM_SLOTS, path=path)


# ---- page keys ----------------------------------------------------------------------------------------------
def test_a_key_range_ending_inside_a_page_is_refused():
    """Keys name whole pages: a range whose end falls inside a page is refused, by both the function and the
    caching keyer, rather than silently answered with the keys of fewer pages than asked for."""
    salt = kv_salt("m", GEOM)
    with pytest.raises(ValueError, match="aligned"):
        page_keys(salt, list(range(16)), 0, 6, 4)
    with pytest.raises(ValueError, match="aligned"):
        PageKeyer(salt, 4).keys(list(range(16)), 4, 10)


# ---- Redis limits ---------------------------------------------------------------------------------------------
def test_a_bulk_limit_exactly_one_value_long_lets_writes_through():
    """Redis refuses a bulk longer than proto-max-bulk-len, not one of exactly that length: a server whose
    limit equals one page's value takes the writes (and a limit one byte shorter refuses them)."""
    value_bytes = (1 << 20) + 4096
    limits = limits_from_config({"proto-max-bulk-len": str(value_bytes)}, value_bytes)
    assert limits.writes_known and limits.value_limit is None
    limits = limits_from_config({"proto-max-bulk-len": str(value_bytes - 1)}, value_bytes)
    assert limits.value_limit == ("proto-max-bulk-len", value_bytes - 1)


class _Answering:
    """A client of a server that is up (PING answers)."""

    async def ping(self) -> bool:
        return True


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["invalid_bulk", "reset"])
async def test_a_small_page_s_failed_write_never_refuses_writes_as_too_large(how):
    """A page value under 1 MiB fits every proto-max-bulk-len a server accepts: a write of one that fails
    (a connection reset while the server still answers, or an "invalid bulk length" reply) is an ordinary
    failure, not a reason to refuse every write for the recheck interval as a value too large."""
    value_bytes = GEOM.bytes_per_page + 24
    refusals = Refusals("redis://127.0.0.1:1/0", value_bytes, GEOM.page_size, ServerLimits())
    if how == "invalid_bulk":
        exc = rexc.ResponseError("Protocol error: invalid bulk length")
    else:
        exc = rexc.ConnectionError("Connection reset by peer")
        exc.__cause__ = ConnectionResetError(errno.ECONNRESET, "reset")
    assert await refusals.write_failed(_Answering, exc) is None
    assert refusals.writes is None
    assert await refusals.refused_writes(_Answering) is None


# ---- the Redis store ------------------------------------------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
async def test_a_hint_table_smaller_than_the_prefix_in_redis_hints_as_many_pages_as_it_holds(server):
    """Redis holds a prompt's 8 pages and this engine's hint table (its L3 slots) has room for 4: the hint
    refresh publishes the prompt's first 4 pages (a restorable head), not nothing."""
    mgr = make_manager(storage_pages=4, storage_backend="redis", storage_url=server.url(), model_id="m")
    store = mgr.store
    tokens = tuple(range(300, 332))  # 8 pages of 4 tokens
    keys = store.page_keys(tokens, 0, 32)
    src = random_pages(mgr.geometry, 4)
    await store.write_pages(src, [0, 1, 2, 3], [0, 1, 2, 3], keys[:4])
    await store.write_pages(src, [0, 1, 2, 3], [0, 1, 2, 3], keys[4:])
    await store.refresh_hints(mgr, tokens)
    assert store.counters["hint_pages_found"] == 8
    assert store.counters["hint_pages_published"] == 4
    assert mgr.tree.match(tokens, include_storage=True, touch=False).lengths[Tier.L3] == 16
    assert_whole(mgr)
    await mgr.close()


@needs_redis
@pytest.mark.asyncio
async def test_a_hint_refresh_waits_for_a_suspect_delete_sent_just_before_it(server):
    """A request's hint refresh right after a suspect prefix's pages were sent for deletion (a NaN answer)
    waits for that delete, even a slow one, so it hints none of the pages about to vanish (each hint
    would cost a restore that fails "missing")."""
    mgr = make_manager(storage_backend="redis", storage_url=server.url(), model_id="m")
    store = mgr.store
    store.hint_timeout_s = 30.0  # (a bound only: the delete below takes 0.2 s)
    tokens = tuple(range(300, 316))  # 4 pages
    keys = store.page_keys(tokens, 0, 16)
    await store.write_pages(random_pages(mgr.geometry, 4), [0, 1, 2, 3], [0, 1, 2, 3], keys)
    client = store._client()
    delete = client.delete

    async def slow_delete(*names):  # a busy server or network: the delete lands after a while
        await asyncio.sleep(0.2)
        return await delete(*names)

    client.delete = slow_delete
    store.delete_suspect(keys)
    await store.refresh_hints(mgr, tokens)
    assert store.counters["hint_pages_found"] == 0 and store.counters["suspect_pages_deleted"] == 4
    assert mgr.tree.match(tokens, include_storage=True, touch=False).lengths[Tier.L3] == 0
    assert server.client().exists(*keys) == 0
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_suspect_pages_are_not_deleted_on_a_server_the_store_backs_off():
    """While the store backs off a dead server, deleting a suspect prefix's pages sends nothing: no
    operation in flight, no further error counted and the back-off not lengthened by it."""
    store = make_store(refused_url(), backoff_s=(30.0, 30.0))
    keys = store.page_keys(list(range(8)), 0, 8)
    src = random_pages(GEOM, 2)
    with pytest.raises(StorageError):
        await store.write_pages(src, [0, 1], [0, 1], keys)  # refused: the store backs off for 30 s
    errors, until = dict(store.stats()["errors"]), store._down_until
    store.delete_suspect(keys)
    assert store.stats()["in_flight"] == 0
    await store.settle_deletes()
    assert store.stats()["errors"] == errors and store._down_until == until
    await store.aclose()

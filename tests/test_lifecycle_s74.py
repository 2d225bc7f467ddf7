"""Lifecycle misuse hunt (session 74): a CacheManager used after close(). A file L3 refuses at once once closed
(FileStore raises StorageError "closed" as a write or read is submitted; the Redis L3 fails the operation's future):
a backup's L3 write, an L3 restore and a prefetch started after the close must fail "closed", as the Redis L3's do,
with the tiers whole (regression: the refusal escaped the backup's driver and the restore's start, logged as a
driver's bug with its traceback, "op_driver_error" / "op_start_error", and counted as a "driver" failure). And a file
L3 closed from a callback of its own operation's future (on its I/O thread) says so and stays open."""
from __future__ import annotations

import threading
import time

import pytest
from structlog.testing import capture_logs

from hicache.radix import Tier
from hicache.storage import FileStore
from hicache_helpers import assert_whole, make_manager, write_prefix
from redis_server import GEOM, random_pages

TOKENS = tuple(range(16))


def _driver_bug_logged(logs: list[dict]) -> list[str]:
    return [e["event"] for e in logs if e["event"] in ("op_driver_error", "op_start_error")]


@pytest.mark.asyncio
async def test_a_backup_started_after_close_fails_closed_not_as_a_driver_bug():
    mgr = make_manager(write_policy="write_through")
    await mgr.close()
    with capture_logs() as logs:
        assert write_prefix(mgr, TOKENS) is not None  # (write-through: its backup starts)
        await mgr.drain()
    assert not _driver_bug_logged(logs)
    assert mgr.metrics.failures == {"closed": 1}
    assert mgr.match(TOKENS).lengths == [16, 16, 0]  # (its L2 copy went through: L3 alone refused)
    assert_whole(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("source", ["l3", "prefetch"])
async def test_a_read_of_l3_started_after_close_fails_closed_not_as_a_driver_bug(source):
    mgr = make_manager(write_policy="write_through")
    write_prefix(mgr, TOKENS)
    await mgr.drain()
    await mgr.flush_async(Tier.L1)
    await mgr.flush_async(Tier.L2)
    await mgr.close()
    match = mgr.match(TOKENS + (1,))
    assert match.lengths == [0, 0, 16]
    with capture_logs() as logs:
        assert mgr.runner.start_restore(TOKENS, match, source, None) is None  # (its caller recomputes)
        await mgr.drain()
    assert not _driver_bug_logged(logs)
    assert mgr.metrics.failures == {"closed": 1}
    assert_whole(mgr)


def _write_whose_callback_closes(store: FileStore):
    """A one-page write queued behind a gate on the store's one I/O thread, with a done-callback (run on that thread)
    that calls store.close(): (the gate, the write's future, an Event set once the callback ran, what it raised)."""
    gate, called = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    store._pool.submit(gate.wait, 10)  # (the write queues behind it: its callback is added before it runs)
    future = store.write_pages(random_pages(GEOM, 1), [0], [0])

    def close_here(_future):
        try:
            store.close()
        except BaseException as exc:  # noqa: BLE001 - (what the tests check)
            errors.append(exc)
        finally:
            called.set()
    future.add_done_callback(close_here)
    return gate, future, called, errors


def test_a_file_store_closed_from_its_own_operations_callback_says_so_and_stays_whole(tmp_path):
    """A done-callback of a write's future runs on the store's I/O thread; close() there would wait for that very
    thread: a clear RuntimeError, the store left open, and a later close() from another thread releases the file
    (regression: "cannot join current thread" out of the pool's shutdown, the store marked closed with its file,
    lock and checksum threads kept, and every later close() a no-op: the path stayed locked)."""
    path = str(tmp_path / "l3.bin")
    store = FileStore(GEOM, num_slots=4, path=path, io_workers=1)
    gate, future, called, errors = _write_whose_callback_closes(store)
    gate.set()
    future.result(timeout=10)
    assert called.wait(10)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "own" in str(errors[0]), errors
    assert not store.closed
    store.close()
    assert store.closed
    FileStore(GEOM, num_slots=4, path=path).close()  # (the path's lock went with the close)


def test_a_close_on_an_io_thread_while_another_thread_closes_is_a_no_op(tmp_path):
    """close() of a store already closed is a no-op from any thread, its own I/O threads too (regression: the
    own-thread check ran before the `_closed` test, so a write's done-callback closing the store while another
    thread's close() drained the pool got a RuntimeError)."""
    store = FileStore(GEOM, num_slots=4, path=str(tmp_path / "l3.bin"), io_workers=1)
    gate, future, called, errors = _write_whose_callback_closes(store)
    closer = threading.Thread(target=store.close)  # waits for the queued write, whose callback then runs
    closer.start()
    deadline = time.monotonic() + 10
    while not store.closed and time.monotonic() < deadline:
        time.sleep(0.001)
    assert store.closed
    gate.set()
    assert called.wait(10)
    closer.join(10)
    assert not closer.is_alive()
    assert errors == []
    assert future.result(timeout=10).num_bytes == GEOM.bytes_per_page

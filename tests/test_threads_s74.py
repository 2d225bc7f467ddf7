"""Code that runs off the event loop's thread (session 74's hunt): the L3 FileStore's I/O threads resolve a verified
read's `landed` future (hicache/storage_op.py, `task_landed`). That future is handed to callers, and a caller's
wait can cancel it: `asyncio.wrap_future(read.landed)` under a `wait_for` that times out cancels the concurrent
future it wraps. Pinned here: a cancelled wait leaves the read as it was (its own future cannot be cancelled, "I/O
cannot be abandoned midway"); before, the I/O thread's `landed.set_result` raised InvalidStateError, which either
failed the read with that error or (checksums after landing) left its checksums counted and never started, so the
read's future never resolved. The I/O thread is held by a gate (threading.Event), so the cancel always comes first."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hicache.storage import FileStore
from test_storage import SMALL, _bytes_equal, _random_pages


def _gated(store: FileStore) -> threading.Event:
    """Hold the store's only I/O thread until the returned gate is set."""
    gate, busy = threading.Event(), threading.Event()
    store._pool.submit(lambda: (busy.set(), gate.wait(10)))
    assert busy.wait(5)
    return gate


@pytest.mark.parametrize("after_landing", [False, True])
def test_a_cancelled_wait_for_landed_leaves_the_read_whole(after_landing):
    src = _random_pages(SMALL, 4, seed=74)
    with FileStore(SMALL, num_slots=8, io_workers=1) as s:
        s.write_pages(src, range(4), range(4)).result(timeout=10)
        gate = _gated(s)
        dst = torch.zeros_like(src)
        fut = s.read_pages(range(4), dst, range(4), checksums_after_landing=after_landing)
        fut.landed.cancel()  # (a caller's give-up; the read is already queued)
        gate.set()
        assert fut.result(timeout=5).num_bytes == 4 * SMALL.bytes_per_page
        assert fut.landed.result(timeout=5) is None
        assert _bytes_equal(src, dst)


def test_an_asyncio_wait_for_landed_that_times_out_leaves_the_read_whole():
    """The same through asyncio: wait_for's timeout cancels the wrapper, which cancels what it wraps."""
    src = _random_pages(SMALL, 4, seed=75)
    with FileStore(SMALL, num_slots=8, io_workers=1) as s:
        s.write_pages(src, range(4), range(4)).result(timeout=10)
        gate = _gated(s)
        dst = torch.zeros_like(src)
        fut = s.read_pages(range(4), dst, range(4), checksums_after_landing=True)

        async def give_up() -> None:
            with pytest.raises(asyncio.TimeoutError):  # (the gate holds the read: it cannot land meanwhile)
                await asyncio.wait_for(asyncio.wrap_future(fut.landed), 0.01)

        asyncio.run(give_up())
        gate.set()
        assert fut.result(timeout=5).num_bytes == 4 * SMALL.bytes_per_page
        assert _bytes_equal(src, dst)

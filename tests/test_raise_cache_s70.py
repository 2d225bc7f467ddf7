"""Session 70's raise hunt in the hierarchical cache: a call that raises while an operation is being started,
before its driver is registered (hicache/operations.py `_register`), must not leave the op half-built.

Starting a backup, a restore or a prefetch locks its sources and takes private destination pages, then enqueues
its copy (TransferEngine.d2h / h2d / h2d_layerwise) or its read (FileStore.read_pages). Any of those raising (a
copy that cannot be enqueued, a store that refuses the read, a bug) escaped with the locks and pages held by no
op, for good (check_integrity: "private pages leaked", nodes locked), and:
- a restore's, out of admission, crashed the engine loop: every live request failed, and every later one was
  refused until start() (and shutdown() raised it again);
- a prefetch's, out of add_request: the client got a bare RuntimeError for a prompt L3 held;
- a backup's, out of the write_back eviction veto (`write_back_keep`), stopped the eviction half-way: the leaves
  it had vetoed were never offered for eviction again;
- taking a landed prefetch on to L1 (`take_to_l1`) crashed the engine loop.
Now the op ends FAILED (counted as a driver error), its locks and pages go back, and its caller goes on as for an
op not made: the request recomputes (the output of an engine without a cache), a prefetch not taken on is
restored from L2 once it landed, and the engine keeps serving.

Also pinned, from the same hunt: the tree's eviction left itself whole when a callback (the veto, `on_evict`)
raised on its second leaf; the cache's close closed the L3 file when the copy streams' close or the index's save
raised before it (and the engine's shutdown closed its model runner); a driver error whose own log line raised
still ended its op (its request waited forever); and an L3 read whose later task could not be queued failed through
its future once the tasks queued before it ended, not out of read_pages while they still read.
"""
from __future__ import annotations

import asyncio
import errno
import threading

import pytest
import structlog
import torch

from hicache import l3_index, storage
from hicache.geometry import KVGeometry
from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, toks, write_prefix
from scheduler.request import RequestError, SamplingParams
from test_faults import PROMPT, REUSABLE, make_engine, only_in_l3, reference
from test_radix import make_tree, put

HANG_GUARD_S = 20  # a client with no last event by then would wait forever
OTHER = [7] * 30  # a prompt nothing cached: its write-through backup starts


class RaiseOnce:
    """Replaces `obj.name`; its first call raises `exc`, later ones call the real method."""

    def __init__(self, obj, name: str, exc: Exception | None = None) -> None:
        self.real, self.calls = getattr(obj, name), 0
        self.exc = RuntimeError("cannot enqueue") if exc is None else exc
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise self.exc
        return self.real(*args, **kwargs)


async def _output(eng, prompt: list[int]) -> list[int] | None:
    """The request's output tokens; None where it ended with an error or no last event came within the guard."""
    req = eng.add_request(prompt, SamplingParams(max_tokens=4))
    out = []
    try:
        while True:
            ev = await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)
            if ev.finished:
                return out if ev.finish_reason == "length" else None
            out.append(ev.token_id)
    except asyncio.TimeoutError:
        return None


def _faults(eng, where: str) -> list[RaiseOnce]:
    cache = eng.cache
    if where == "backup":
        return [RaiseOnce(cache.transfer, "d2h")]
    if where == "restore_l2":  # (its copy goes layer by layer where the request runs alone)
        return [RaiseOnce(cache.transfer, "h2d_layerwise"), RaiseOnce(cache.transfer, "h2d")]
    return [RaiseOnce(cache.store, "read_pages")]


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["backup", "restore_l2", "restore_l3", "prefetch"])
async def test_an_op_whose_start_raises_falls_back_and_leaves_the_tiers_whole(where):
    """The faulted request gets the recompute's output, the next one is served, and after a drain no page is
    private and no node locked (regression: the op's pages and locks leaked; a restore's error crashed the engine
    loop, a prefetch's escaped add_request)."""
    eng = make_engine(prefetch=where == "prefetch")
    await eng.start()
    want = await reference(PROMPT)
    assert await _output(eng, PROMPT) == want
    await eng.cache.drain()
    if where == "restore_l2":
        eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    elif where != "backup":
        only_in_l3(eng, PROMPT[:REUSABLE])
    faults = _faults(eng, where)
    prompt = OTHER if where == "backup" else PROMPT
    assert await _output(eng, prompt) == await reference(prompt)
    assert sum(f.calls for f in faults) >= 1, "the fault was never reached"
    assert await _output(eng, PROMPT) == want  # the engine keeps serving
    await eng.cache.drain()
    for tier in (Tier.L1, Tier.L2, Tier.L3):
        assert eng.cache.allocator(tier).num_private() == 0, f"{tier.name}: the op's pages leaked"
    assert_whole(eng.cache, driver_errors=1)  # (and it ended counted as a driver error)
    await eng.shutdown()


async def served_then_only_in_l3():
    """A started prefetching engine that served PROMPT, its reusable prefix then left in L3 only; and PROMPT's output."""
    eng = make_engine(prefetch=True)
    await eng.start()
    want = await reference(PROMPT)
    assert await _output(eng, PROMPT) == want
    await eng.cache.drain()
    only_in_l3(eng, PROMPT[:REUSABLE])
    return eng, want


@pytest.mark.asyncio
async def test_a_prefetch_whose_take_on_raises_is_restored_once_landed():
    """Taking a landed prefetch on to L1 raised out of admission and crashed the engine loop. Now the request
    stays parked on the prefetch and is restored from L2 once it landed: recompute's output, every tier whole."""
    eng, want = await served_then_only_in_l3()
    fault = RaiseOnce(eng.cache.transfer, "h2d_layerwise")
    taken = []  # (what each take-on returned, whether the fault fired in it)
    real_take = eng.cache.runner.take_to_l1

    def take_to_l1(*args, **kwargs):
        before = fault.calls
        taken.append((real_take(*args, **kwargs), fault.calls > before == 0))
        return taken[-1][0]
    eng.cache.runner.take_to_l1 = take_to_l1
    assert await _output(eng, PROMPT) == want
    assert taken and taken[0] == (False, True), f"the take-on was not tried, or did not raise: {taken}"
    assert await _output(eng, PROMPT) == want
    await eng.cache.drain()
    assert_whole(eng.cache)  # (no op failed: the prefetch went on to L2)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_write_back_veto_whose_backup_cannot_start_lets_the_eviction_finish():
    """Under write_back an L1 eviction backs up an unsaved leaf before it goes (`write_back_keep`): that backup's
    copy raising to enqueue stopped the eviction half-way (the allocation raised; the leaves vetoed before it
    were never offered again). Now the backup fails, the leaf goes unsaved and the allocation gets its pages."""
    mgr = make_manager(l1_pages=8, host_pages=32, storage_pages=0, write_policy="write_back")
    a, b, c = toks((0, 16)), toks((100, 116)), toks((200, 216))
    assert write_prefix(mgr, a) is not None and write_prefix(mgr, b) is not None  # L1 full, nothing saved
    await mgr.drain()
    fault = RaiseOnce(mgr.transfer, "d2h")
    pages = write_prefix(mgr, c)  # evicts: the first leaf's backup raises, the second's is copied
    assert fault.calls >= 1
    assert pages is None or len(pages) == 4
    await mgr.drain()
    mgr.tree.check_integrity()
    assert write_prefix(mgr, c) is not None or mgr.tree.match(c, touch=False).lengths[Tier.L1] == 16
    await mgr.drain()
    assert_whole(mgr, driver_errors=1)
    await mgr.close()


@pytest.mark.parametrize("raises", ["on_evict", "keep"])
def test_an_eviction_whose_callback_raises_leaves_the_tree_whole(raises):
    """The tree's eviction calls back for each leaf: its veto (write_back's backup of an unsaved leaf) and
    `on_evict`. One raising on the second leaf left that leaf in the tree with no page in any tier ("empty leaf"),
    or dropped the leaves vetoed before it, and the one it was asked about, from eviction's candidates for good."""
    tree, allocs = make_tree()
    for i in range(4):
        put(tree, allocs, list(range(100 * i, 100 * i + 8)), Tier.L2)
    asked = []

    def callback(*args) -> bool:
        asked.append(args)
        if len(asked) == 2:
            raise RuntimeError("callback failed")
        return raises == "keep"  # (the veto keeps the first leaf)
    if raises == "keep":
        with pytest.raises(RuntimeError):
            tree.evict(Tier.L2, 16, keep=callback)
    else:
        tree.on_evict = callback
        with pytest.raises(RuntimeError):
            tree.evict(Tier.L2, 16)
        tree.on_evict = None
    tree.check_integrity()
    tree.evict(Tier.L2, 100)  # every leaf is found again
    assert allocs[Tier.L2].num_free == allocs[Tier.L2].num_pages
    tree.check_integrity()


@pytest.mark.asyncio
@pytest.mark.parametrize("raises", ["copy streams", "index save"])
async def test_a_shutdown_whose_tier_close_raises_still_closes_the_l3_file(tmp_path, monkeypatch, raises):
    """Closing the cache closes the copy streams (on CUDA their synchronize re-raises a device error), saves a kept
    L3 file's index, then closes the file: either raising left the file, its I/O threads and its lock open, and
    the next engine on the same path was refused ("another store has it open"). The error still surfaces."""
    kw = dict(storage_path=str(tmp_path / "l3"), storage_persist=True)
    eng = make_engine(**kw)
    await eng.start()
    assert await _output(eng, PROMPT) == await reference(PROMPT)
    if raises == "copy streams":
        def close():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        monkeypatch.setattr(eng.cache.transfer, "close", close)
    else:
        def savez(*args, **kwargs):
            raise ValueError("cannot save")
        monkeypatch.setattr(l3_index.np, "savez", savez)
    with pytest.raises((RuntimeError, ValueError)):
        await eng.shutdown()
    assert eng.cache.store.closed
    # (and the model's runner closed, the engine marked shut down: regression, a raise in the tiers' closing
    # skipped both, and a new request was told "shutting down" for good)
    assert eng.runner._waiter._shutdown
    with pytest.raises(RequestError, match="has shut down"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    monkeypatch.undo()
    again = make_engine(**kw)  # (raised ValueError: another store has it open)
    await again.shutdown()


@pytest.fixture
def driver_errors_unloggable():
    """structlog set up with a processor that raises on the "op_driver_error" line (an exception renderer that
    fails on the traceback's locals, a full disk: hicache/log_gate.py `log_anyway`); other lines go through."""
    saved = structlog.get_config()

    def refuse(_logger, _method, event_dict):
        if event_dict.get("event") == "op_driver_error":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise structlog.DropEvent
    structlog.configure(processors=[refuse], cache_logger_on_first_use=False)
    try:
        yield
    finally:
        structlog.configure(**saved)


@pytest.mark.asyncio
async def test_a_driver_error_whose_log_line_raises_still_ends_the_op(monkeypatch, driver_errors_unloggable):
    """An op's driver that raised (here an L3 read failing with a non-OSError) is failed and its pages settled by
    `_guard`, after its "op_driver_error" line: that line raising skipped both, so the op never ended, the request
    parked on the restore waited for it forever, and its locks and pages were held for good."""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    assert await _output(eng, PROMPT) == want
    await eng.cache.drain()
    only_in_l3(eng, PROMPT[:REUSABLE])

    def preadv(fd, buffers, offset):
        monkeypatch.undo()  # (once)
        raise ValueError("buffer went away")
    monkeypatch.setattr(storage.os, "preadv", preadv)
    assert await _output(eng, PROMPT) == want, "no output: its client waits forever"
    assert await _output(eng, PROMPT) == want
    await eng.cache.drain()
    assert_whole(eng.cache, driver_errors=1)
    await eng.shutdown()


def test_a_read_whose_second_task_cannot_be_queued_fails_once_the_queued_one_ended(monkeypatch):
    """The L3 store queues a read as several tasks; one that cannot be queued (a thread that cannot start) raised out
    of read_pages while the tasks queued before it still read into the op's pages, and the op's start, given back
    at once (`_not_started`), freed pages a late read then landed in. Now the read fails through its future, once
    the queued tasks ended."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    with storage.FileStore(geometry, num_slots=16, io_workers=4) as store:
        src = torch.randn(geometry.page_major_shape(8))
        slots = [0, 1, 4, 5, 9, 12]  # (fragmented: a task per extent)
        store.write_pages(src, range(6), slots).result(timeout=10)
        gate, submits, real_submit, real_task = threading.Event(), [], store._pool.submit, store._run_task

        def submit(*args):
            submits.append(1)
            if len(submits) == 2:
                raise RuntimeError("can't start new thread")
            return real_submit(*args)

        def held_task(*args):
            assert gate.wait(HANG_GUARD_S)
            return real_task(*args)
        monkeypatch.setattr(store._pool, "submit", submit)
        monkeypatch.setattr(store, "_run_task", held_task)
        future = store.read_pages(slots, torch.zeros_like(src), range(6))  # (regression: raised here)
        assert not future.done()  # (the first task still reads)
        gate.set()
        with pytest.raises(RuntimeError, match="can't start new thread"):
            future.result(timeout=HANG_GUARD_S)

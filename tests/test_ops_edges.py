"""Edges of the cache's bookkeeping found by a bug hunt (session 26), each a regression test: an op
driver task cancelled while it runs (a drain must still wait for its pages; its done-callback must
not clear a newer backup's marks), L3 slots the tree frees other than by eviction (they stop being
readable in the store), and the allocator's referee checking every free-run index."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hicache.allocator import PageAllocator
from hicache.ops import OpState
from hicache.radix import Tier
from hicache.storage import StorageError
from hicache_helpers import assert_whole, flip_l3_byte, l3_only_chain, make_manager, toks, write_prefix

async def _running_backup(mgr, tokens):
    """Publish `tokens` (write-through starts its backup) and let the driver reach its D2H wait."""
    assert write_prefix(mgr, tokens) is not None
    [op] = mgr.runner.live.values()
    task = mgr.runner._tasks[op.op_id]
    await asyncio.sleep(0)  # the driver runs: it is now awaiting its D2H
    assert not task.done()
    return op, task


@pytest.mark.asyncio
async def test_a_drain_waits_for_the_pages_of_a_driver_cancelled_while_it_runs():
    """CacheManager.drain() / OpRunner.drain() loop `while self._tasks or self._settling`. A driver
    whose task is cancelled while it runs pops itself from `_tasks` in `_guard`'s finally, but the
    settle task that frees its pages is only created by the task's done-callback, which runs one
    loop turn later. A drain that starts in between sees neither and returns at once, with the
    op's private L2 pages still held (reliability promise 2: after a drain no page is private)."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    op, task = await _running_backup(mgr, toks((0, 16)))
    task.cancel()
    await asyncio.sleep(0)  # the task unwinds (its finally ran); its done-callback is still queued
    await mgr.drain()
    try:
        assert mgr.allocator(Tier.L2).num_private() == 0, (
            f"drain() returned while {mgr.allocator(Tier.L2).num_private()} L2 pages of the cancelled "
            f"backup were still private (settling tasks: {len(mgr.runner._settling)})")
        assert_whole(mgr)
    finally:
        await asyncio.sleep(0.01)
        await mgr.drain()
        await mgr.close()


@pytest.mark.asyncio
async def test_a_cancelled_backups_callback_leaves_a_newer_backup_of_the_same_tokens_alone():
    """`_drive_backup`'s finally discards its key from `_backing_up` and pops its `_deferred`
    waiters, but leaves `backup_key` in the op's payload, so the done-callback of a cancelled task
    (`_on_task_cancelled`) discards the key and pops `_deferred[key]` a second time. If a new backup
    of the same tokens started in between, its in-flight mark and the extensions waiting on it are
    wiped: the waiting extension is never backed up (and a third backup of the key could start
    beside the second, copying the same pages twice)."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    key = toks((0, 8))
    ext = key + toks((100, 108))
    _, task = await _running_backup(mgr, key)
    task.cancel()
    await asyncio.sleep(0)  # first backup unwound; its done-callback is still queued
    second = mgr.runner.start_backup(key)  # a new backup of the same tokens starts now
    assert second is not None and key in mgr.runner._backing_up
    assert write_prefix(mgr, ext, start=8) is not None  # its write-through backup waits for `second`
    assert mgr.runner._deferred.get(key) == [ext]
    await asyncio.sleep(0)  # the first backup's done-callback runs
    try:
        assert key in mgr.runner._backing_up, "the cancelled backup's callback cleared the newer backup's mark"
        assert mgr.runner._deferred.get(key) == [ext], "the extension waiting on the newer backup was dropped"
    finally:
        await mgr.drain()
        await asyncio.sleep(0.01)
        await mgr.drain()
    m = mgr.tree.match(ext, touch=False)
    try:
        assert m.lengths[Tier.L2] == len(ext), (
            f"the extension was never backed up: L2 holds {m.lengths[Tier.L2]} of {len(ext)} tokens")
    finally:
        await mgr.close()


def _free_slots(mgr) -> list[int]:
    alloc = mgr.allocator(Tier.L3)
    return [s for s in range(alloc.num_pages) if alloc.owner[s] == -1]


def _assert_store_matches_tree(mgr):
    valid = mgr.store.stats()["valid_slots"]
    resident = mgr.tree.num_resident_pages[Tier.L3]
    stale = [s for s in _free_slots(mgr) if mgr.store.exists([s])[0]]
    assert valid == resident and not stale, (
        f"store reports {valid} valid slots, tree holds {resident} L3 pages; free slots still valid: {stale}")


@pytest.mark.asyncio
async def test_normal_path_keeps_store_and_tree_in_step():
    """Control: backups and evictions keep valid_slots == L3 resident pages (this passes)."""
    mgr = make_manager()
    a, b = toks((0, 8)), toks((0, 8)) + toks((100, 108))
    write_prefix(mgr, a)
    await mgr.drain()
    write_prefix(mgr, b, 8)
    await mgr.drain()
    _assert_store_matches_tree(mgr)
    mgr.tree.evict(Tier.L3, 1)
    _assert_store_matches_tree(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_slots_dropped_after_a_checksum_failure_stop_being_readable():
    mgr = make_manager()
    b, m = await l3_only_chain(mgr)
    good_child_slots = m.pages[Tier.L3][2:]  # b's own pages: intact, dropped with their corrupt parent
    flip_l3_byte(mgr, m.pages[Tier.L3][0])
    op = mgr.runner.start_restore(b, m, "l3", "r")
    await mgr.drain()
    assert op.state is OpState.FAILED and "checksum" in op.error
    assert mgr.tree.match(b, touch=False).lengths == [0, 0, 0]
    try:
        _assert_store_matches_tree(mgr)
        # the store's guard ("a slot that holds no completed write fails before any I/O") should
        # cover slots the tree freed (a read of them returned the old page, its checksum passing); refused as
        # such, not by a checksum bound to keys this read does not give (session 71)
        dst = torch.zeros_like(mgr.l2.page_buffer[:2])
        with pytest.raises(StorageError, match="hold no valid page"):
            mgr.store.read_pages(good_child_slots, dst, [0, 1], **mgr.page_keys(b, 8, 16)).result(timeout=10)
    finally:
        await mgr.close()


@pytest.mark.asyncio
async def test_slots_of_a_backup_cancelled_after_its_write_stop_being_readable():
    mgr = make_manager()
    tokens = toks((0, 16))
    write_prefix(mgr, tokens)
    [op] = mgr.runner.live.values()
    for _ in range(200):  # run the loop until the backup waits on its L3 write
        if op.state is OpState.H2S_PENDING:
            break
        await asyncio.sleep(0)
    assert op.state is OpState.H2S_PENDING
    mgr.runner.cancel(op)  # e.g. shutdown's drain(cancel=True)
    await mgr.drain()
    assert op.state is OpState.CANCELLED
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    try:
        _assert_store_matches_tree(mgr)
    finally:
        await mgr.close()


def _setup():
    alloc = PageAllocator(8, "t")
    c = alloc.new_claim("c")
    alloc.alloc(8, c)
    alloc.free([0, 1], c)           # free run [0, 2)
    alloc.give_to_tree([2, 3, 4], c)  # tree owns 2..4
    tree = [2, 3, 4]
    return alloc, c, tree


def test_the_referee_checks_the_run_end_index():
    alloc, c, tree = _setup()
    alloc.check(tree)
    alloc._run_ending[5] = 0  # stale: claims a free run [0, 5) ending at 5 (pages 2..4 are the tree's)
    with pytest.raises(AssertionError):
        alloc.check(tree)  # the referee should reject an index that disagrees with the owner table
    # what it let through: freeing page 5 then merged [0, 6) into one run, and the next alloc(3)
    # returned [0, 1, 2], page 2 being the tree's


def test_the_referee_checks_the_run_start_index():
    alloc, c, tree = _setup()
    alloc._run_at[0] = 5  # wrong length for the free run at 0 (the index keeps its size)
    with pytest.raises(AssertionError):
        alloc.check(tree)

"""A hunt in shutdown and draining: CacheManager.close / drain, OpRunner.drain (cancelling),
backup chains and `backup_soon`, TransferEngine.wait / close. CPU only (TRITON_INTERPRET=1).

The first two guard what was checked and found right (a cancelling drain starts nothing new, and
every tier is whole after it); the last two failed before their fixes (TransferEngine.wait twice on
one transfer; a cancelled drain cancelled the settling of a copy still in flight)."""
from __future__ import annotations

import asyncio

import pytest

from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import (assert_abandoned_read_missed_reused_pages, assert_whole,
                             l3_only_prefix_with_slow_reads, make_manager, toks, until, write_prefix)


@pytest.mark.asyncio
async def test_a_cancelling_drain_starts_none_of_the_backups_waiting_on_one_in_flight():
    """Backup A is copying to L2 (D2H_PENDING, held) while two continuations of it wait for it
    (deferred; once A's L3 write started they would start at once). drain(cancel=True) begins, then
    A's copy completes: A ends cancelled, and neither waiting backup starts (no D2H, no L3 write
    during shutdown); every tier is whole afterwards."""
    mgr = make_manager()
    held, wait = asyncio.Event(), mgr.transfer.wait

    async def held_wait(tr):
        await held.wait()
        return await wait(tr)
    mgr.transfer.wait = held_wait
    a = toks((0, 8))
    write_prefix(mgr, a)
    await until(lambda: any(op.state is OpState.D2H_PENDING for op in mgr.runner.live.values()))
    write_prefix(mgr, a + toks((100, 108)), 8, seed=1)
    write_prefix(mgr, a + toks((200, 208)), 8, seed=2)
    assert len(mgr.runner._deferred[a]) == 2 and mgr.metrics.backups_started == 1
    draining = asyncio.create_task(mgr.drain(cancel=True))
    await asyncio.sleep(0)
    held.set()
    await draining
    assert mgr.metrics.backups_started == 1, "a backup started while a cancelling drain ran"
    assert mgr.metrics.cancellations == 1 and not mgr.runner.live and not mgr.runner._deferred
    assert mgr.tree.match(a + toks((100, 108)), touch=False).lengths == [16, 0, 0]
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_cancelling_drain_drops_the_backups_backup_soon_queued():
    """Backups queued by `backup_soon` (the engine's step processing) and not yet started when a
    cancelling drain begins never start, also when the scheduled hop runs after the drain."""
    mgr = make_manager()
    mgr.defer_backups = True
    write_prefix(mgr, toks((0, 8)))
    write_prefix(mgr, toks((50, 58)), seed=1)
    assert mgr.runner.has_due and mgr.metrics.backups_started == 0
    await mgr.drain(cancel=True)
    for _ in range(5):  # the hop backup_soon scheduled (two loop turns) has run by now
        await asyncio.sleep(0)
    assert mgr.metrics.backups_started == 0 and not mgr.runner.live
    assert_whole(mgr)
    await mgr.close()


def fragmented_d2h(mgr, host_pages: list[int], value: float):
    """L1 pages 0..n-1 filled with `value`, copied (D2H) into `host_pages`, which form more runs
    than the DMAs take: a workspace, then one CPU index copy at completion (`Transfer.finish`)."""
    l1_pages = list(range(len(host_pages)))
    mgr.l1.kv[:, :, l1_pages] = value
    tr = mgr.transfer.d2h(l1_pages, host_pages)
    assert tr.finish is not None and tr.workspace is not None
    return tr


@pytest.mark.asyncio
async def test_waiting_twice_on_a_fragmented_d2h_never_copies_again_from_a_returned_workspace():
    """TransferEngine.wait() ran a transfer's completion on every call: a D2H into fragmented L2
    pages copies from its workspace into L2 at completion, and the workspace goes back once the
    transfer settled. A second wait ran that copy again from the workspace, by then another
    transfer's: the first transfer's L2 pages got the other's KV. A second wait now awaits the
    same completion (and re-raises the same failure); nothing runs twice."""
    mgr = make_manager(l1_pages=16, host_pages=40, storage_pages=0)
    first_pages, other_pages = list(range(0, 18, 2)), list(range(21, 39, 2))  # 9 runs each
    first = fragmented_d2h(mgr, first_pages, 1.0)
    await mgr.transfer.wait(first)
    assert bool((mgr.l2.page_buffer[first_pages] == 1.0).all())
    other = fragmented_d2h(mgr, other_pages, 2.0)  # reuses the workspace `first` gave back
    await mgr.transfer.wait(first)
    assert bool((mgr.l2.page_buffer[first_pages] == 1.0).all()), "a second wait copied another transfer's KV"
    await mgr.transfer.wait(other)
    assert bool((mgr.l2.page_buffer[other_pages] == 2.0).all())
    assert all(not ws.busy for ws in mgr.transfer.workspaces)
    await mgr.close()



@pytest.mark.asyncio
async def test_a_cancelled_drain_leaves_pages_under_a_copy_in_flight_held():
    """A drain whose caller is cancelled (replay's dispatcher is cancelled where it awaits
    `engine.cache.drain()` when the engine loop dies) cancelled what it gathered: the settling of
    an abandoned L3 read, which then freed the op's L2 pages at once although the read was still
    in flight; a backup took them and the late read landed in them (L2 held other KV for that
    prefix). Cancelling a drain now only stops the wait."""
    mgr, a, b, m = await l3_only_prefix_with_slow_reads()  # 4 pages each; L2 holds 4 pages in all
    op = mgr.runner.start_restore(a, m, "l3", "req")
    task = mgr.runner._tasks[op.op_id]
    task.cancel()  # its pages now wait for the read to settle
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert mgr.runner._settling and not op.payload["read"].done()
    draining = asyncio.create_task(mgr.drain())
    await asyncio.sleep(0.01)
    draining.cancel()
    with pytest.raises(asyncio.CancelledError):
        await draining
    await asyncio.sleep(0.01)
    assert not op.payload["read"].done()
    assert mgr.allocator(Tier.L2).num_private() == 4, "L2 pages freed while a read into them was in flight"
    await assert_abandoned_read_missed_reused_pages(mgr, op, b)
    assert_whole(mgr)
    await mgr.close()

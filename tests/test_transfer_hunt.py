"""Bugs found by a hunt in the L1 <-> L2 transfer engine and the drivers that use it (backups,
restores): each test failed before its fix. CPU only (TRITON_INTERPRET=1)."""
from __future__ import annotations

import asyncio

import pytest

from hicache.ops import OpState
from hicache_helpers import (WriteGate, assert_abandoned_read_missed_reused_pages, assert_whole,
                             l3_only_prefix_with_slow_reads, make_manager, toks, write_prefix)


@pytest.mark.asyncio
@pytest.mark.parametrize("tier, take_soon", [("l3", False), ("prefetch", False), ("prefetch", True)])
async def test_a_read_abandoned_by_a_driver_cancelled_before_it_ran_never_lands_in_reused_pages(tier, take_soon):
    """An L3 restore's driver task cancelled before its first step: its L2 pages were freed at once
    although its S2H read was still in flight; the read then landed in pages a backup had taken
    and published meanwhile (L2 held the wrong KV for that prefix)."""
    mgr, a, b, m = await l3_only_prefix_with_slow_reads()  # 4 pages each; L2 holds 4 pages in all
    op = mgr.runner.start_restore(a, m, tier, "req", take_soon=take_soon)  # (take_soon: checksums held)
    task = mgr.runner._tasks[op.op_id]
    task.cancel()  # before it ever ran
    with pytest.raises(asyncio.CancelledError):
        await task
    assert op.state is OpState.CANCELLED
    await asyncio.sleep(0.05)  # its settling ran
    await assert_abandoned_read_missed_reused_pages(mgr, op, b)
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_backup_whose_driver_is_cancelled_during_its_l3_write_leaves_no_readable_free_slot():
    """A backup's driver task cancelled while its H2S write is in flight: the op's slots are freed
    once the write settled, and the write had validated them: they are invalidated as they are
    freed (before the fix free L3 slots stayed readable, a stale read of a reused slot would pass
    its checks, and check_integrity failed)."""
    mgr = make_manager(l1_pages=16, host_pages=8, storage_pages=16)
    gate = WriteGate(mgr.store)  # the bytes are written; the completion is held back
    write_prefix(mgr, toks((1, 17)))
    for _ in range(200):
        writing = [op for op in mgr.runner.live.values() if op.state is OpState.H2S_PENDING]
        if writing:
            break
        await asyncio.sleep(0.005)
    [op] = writing
    mgr.runner._tasks[op.op_id].cancel()
    await asyncio.sleep(0.01)
    gate.release()
    await mgr.drain()
    assert op.state is OpState.CANCELLED
    try:
        assert_whole(mgr)
    finally:
        await mgr.close()

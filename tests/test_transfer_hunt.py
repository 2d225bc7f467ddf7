"""Bugs found by a hunt in the L1 <-> L2 transfer engine and the drivers that use it (backups,
restores): each test failed before its fix. CPU only (TRITON_INTERPRET=1)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import assert_whole, l1_bytes, make_manager, toks, write_prefix


@pytest.mark.asyncio
@pytest.mark.parametrize("tier, take_soon", [("l3", False), ("prefetch", False), ("prefetch", True)])
async def test_a_read_abandoned_by_a_driver_cancelled_before_it_ran_never_lands_in_reused_pages(tier, take_soon):
    """An L3 restore's driver task cancelled before its first step: its L2 pages were freed at once
    although its S2H read was still in flight; the read then landed in pages a backup had taken
    and published meanwhile (L2 held the wrong KV for that prefix)."""
    faults = FaultInjector()
    mgr = make_manager(l1_pages=16, host_pages=4, storage_pages=64, faults=faults)
    a, b = toks((1, 17)), toks((500, 516))  # 4 pages each; L2 holds 4 pages in all
    write_prefix(mgr, a, seed=1)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 10 ** 9)
    mgr.tree.evict(Tier.L2, 10 ** 9)
    m = mgr.match(a)
    assert m.lengths == [0, 0, 16]
    faults.arm(Fault.SLOW_READ, delay_s=0.3)
    op = mgr.runner.start_restore(a, m, tier, "req", take_soon=take_soon)  # (take_soon: checksums held)
    task = mgr.runner._tasks[op.op_id]
    task.cancel()  # before it ever ran
    with pytest.raises(asyncio.CancelledError):
        await task
    assert op.state is OpState.CANCELLED
    await asyncio.sleep(0.05)  # its settling ran
    write_prefix(mgr, b, seed=2)  # its backup needs every L2 page (skipped while they are held)
    await mgr.drain()
    try:  # the abandoned read has landed
        await asyncio.wrap_future(op.payload["read"])
    except Exception:
        pass
    await mgr.drain()
    mgr.runner.start_backup(b)  # (a no-op when b was backed up above)
    await mgr.drain()
    mb = mgr.tree.match(b, touch=False)
    assert mb.lengths == [16, 16, 16]
    assert torch.equal(mgr.l2.page_buffer[mb.pages[Tier.L2]].view(torch.uint8),
                       mgr.l1.kv[:, :, mb.pages[Tier.L1]].permute(2, 0, 1, 3, 4, 5).contiguous().view(torch.uint8)), \
        "b's L2 pages hold other KV: the abandoned read landed in them"
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_backup_whose_driver_is_cancelled_during_its_l3_write_leaves_no_readable_free_slot():
    """A backup's driver task cancelled while its H2S write is in flight: the op's slots are freed
    once the write settled, and the write had validated them: they are invalidated as they are
    freed (before the fix free L3 slots stayed readable, a stale read of a reused slot would pass
    its checks, and check_integrity failed)."""
    import concurrent.futures as cf
    import threading

    mgr = make_manager(l1_pages=16, host_pages=8, storage_pages=16)
    gate, real_write = threading.Event(), mgr.store.write_pages

    def held_write(*args, **kwargs):  # the bytes are written; the completion is held back
        inner, outer = real_write(*args, **kwargs), cf.Future()

        def relay():
            gate.wait(10)
            try:
                outer.set_result(inner.result())
            except BaseException as exc:
                outer.set_exception(exc)
        threading.Thread(target=relay, daemon=True).start()
        return outer
    mgr.store.write_pages = held_write
    write_prefix(mgr, toks((1, 17)))
    for _ in range(200):
        writing = [op for op in mgr.runner.live.values() if op.state is OpState.H2S_PENDING]
        if writing:
            break
        await asyncio.sleep(0.005)
    [op] = writing
    mgr.runner._tasks[op.op_id].cancel()
    await asyncio.sleep(0.01)
    gate.set()
    await mgr.drain()
    assert op.state is OpState.CANCELLED
    try:
        assert_whole(mgr)
    finally:
        await mgr.close()

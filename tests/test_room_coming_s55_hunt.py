"""Regression from session 55's preemption hunt: an L3 restore whose H2D found L1 short while a write_through
backup copied the pages it was to evict failed ("no L1 pages for the H2D step", failures["no_pages"]) although
that room comes back once the copy ends: `l1_room_coming()` counted copying backups under write_back only. At
decode_reserve_ratio below 1 a preempted request's published K/V is such a backup, and a resumption's L3 restore
failed so (its read stayed in L2 and the request restored from there: outputs right, a failure counted)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hicache.ops import OpKind, OpState
from hicache.radix import Tier
from hicache_helpers import ReadGate, assert_whole, make_manager, toks, until, write_prefix
from test_faults import TransferGate


async def restore_waiting_for_room(write_policy: str = "write_through") -> SimpleNamespace:
    """An L3 restore of `a` (4 pages) whose read landed and whose H2D waits for L1 room: L1 (8 pages) holds a running
    request's 4 pages and `b`'s 4, published and held in their backup's D2H (`copies`, a TransferGate)."""
    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=64, write_policy=write_policy)
    a, b = toks((1, 17)), toks((500, 516))  # 4 pages each
    write_prefix(mgr, a)
    await mgr.flush_async(Tier.L1)
    await mgr.drain()
    mgr.flush(Tier.L2)
    match = mgr.match(a)
    assert match.lengths == [0, 0, 16]
    reads = ReadGate(mgr.store)
    restore = mgr.runner.start_restore(a, match, "l3", "req")  # (its read held)
    copies = TransferGate(SimpleNamespace(cache=mgr), "d2h")
    claim = mgr.new_claim("request")
    held = mgr.alloc_l1(4, claim)  # (half of L1 a running request's)
    write_prefix(mgr, b)  # (the other half: b, published; its backup copies it, held)
    if write_policy == "write_back":
        mgr.runner.start_backup(b)  # (write_back backs up on eviction: started here as an eviction would)
    mgr.runner.start_due()
    await until(lambda: any(op.kind is OpKind.BACKUP and op.state is OpState.D2H_PENDING
                            for op in mgr.runner.live.values()))
    reads.release()  # the read lands; its H2D needs b's 4 pages, locked while they copy
    await until(lambda: restore.state not in (OpState.L3, OpState.S2H_PENDING, OpState.S2H_LANDED))
    return SimpleNamespace(mgr=mgr, a=a, restore=restore, copies=copies, claim=claim, held=held)


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.asyncio
async def test_an_l3_restore_waits_for_a_backup_copying_the_l1_room_it_needs(write_policy):
    w = await restore_waiting_for_room(write_policy)
    mgr, a, restore, copies, claim, held = w.mgr, w.a, w.restore, w.copies, w.claim, w.held
    await asyncio.sleep(0.05)
    copies.release.set()  # b copied: its pages may go
    await mgr.drain()
    assert restore.state is OpState.L1_L2_L3, (restore.state, restore.error)
    assert mgr.metrics.failures == {}  # (regression: {"no_pages": 1} under write_through)
    assert mgr.tree.match(a, touch=False).lengths[Tier.L1] == 16
    mgr.release_claim(claim)
    del held
    assert_whole(mgr)
    await mgr.close()

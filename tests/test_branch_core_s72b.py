"""Session 72 branch-coverage hunt, core (the cache's op runner, hicache/operations.py): the sides of branches no test
took, each pinned as the rule it is.

- A failed L3 read whose bad pages lie on a node AND on a node below it: dropping the upper node's pages from its
  first bad one takes the lower node's pages with them (RadixTree.drop), and `_drop_l3_slots` then finds the lower
  node holding no L3 pages and drops nothing more: storage_missing_pages counts each lost page once (L3's residency
  stays what was written less what was lost), the pages before the first bad one stay an L3 hit, and they read back.
  (So it needs no "still in the tree" guard, removed this session: a node leaves the tree once no tier holds pages.)
- A prefix dropped as suspect (a request that reused it got NaN logits) stops the restores that copy it, and only
  those (`stop_restores_of`): a restore of an unrelated prefix in flight beside it goes on and lands its pages byte
  for byte (regression guard: stopping every live restore would make each NaN recompute every restoring request).
- `cancel` of no op, or of one that already ended, changes nothing: the ended op keeps its state, is not marked
  cancelled and no cancellation is counted (callers pass a request's restore / prefetch op, None or ended).
- An op's abandoned pages are held until its copy settles (`_settle_then_release`); where that settling task is itself
  cancelled (an asyncio.run() ending cancels every task left) they are held on until the copy settled, then freed: no
  private page leaks, and none is reused while the copy still runs into it (session 75: freed at the cancel before)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hicache.ops import OpKind, OpState
from hicache.radix import Tier
from hicache.suspect import drop_suspect_prefix
from hicache_helpers import assert_whole, flip_l3_byte, hold_copies, l1_bytes, make_manager, write_prefix


@pytest.mark.asyncio
async def test_bad_l3_pages_on_a_node_and_below_it_are_dropped_and_counted_once():
    mgr = make_manager()
    upper, whole = tuple(range(16)), tuple(range(32))
    write_prefix(mgr, upper)
    write_prefix(mgr, whole, start=16, seed=1)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    m = mgr.tree.match(whole, touch=False)
    assert m.lengths == [0, 0, 32] and len(m.path) == 2, m  # two L3-only nodes: 4 pages, then 4 below
    flip_l3_byte(mgr, m.pages[Tier.L3][1])  # the upper node's 2nd page
    flip_l3_byte(mgr, m.pages[Tier.L3][5])  # the lower node's 2nd page
    written = mgr.tree.num_resident_pages[Tier.L3]
    op = mgr.runner.start_restore(whole, m, "l3", "r")
    await mgr.drain()
    assert op.state is OpState.FAILED and "checksum" in op.error
    assert mgr.tree.match(whole, touch=False).lengths == [0, 0, 4]
    assert mgr.metrics.storage_missing_pages == 7, "a lost page was counted twice (or not at all)"
    assert mgr.tree.num_resident_pages[Tier.L3] == written - 7 == 1
    assert_whole(mgr)
    op = mgr.runner.start_restore(whole, mgr.tree.match(whole, touch=False), "l3", "r2")
    await mgr.drain()
    assert op.succeeded and mgr.tree.match(whole, touch=False).lengths == [4, 4, 4]
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_cancelled_settling_still_frees_the_ops_pages():
    """An op holding 2 private L1 pages, abandoned with a copy in flight: its pages stay reserved while the copy
    runs, also once the settling task is cancelled (an asyncio.run() that ends); they are freed as the copy settles,
    and the settling then ends cancelled."""
    mgr = make_manager(storage_pages=0)
    runner = mgr.runner
    op = runner._new(OpKind.RESTORE_L2, 2, "r")
    claim = runner._claim(op, Tier.L1)
    assert len(mgr.alloc_pages(Tier.L1, 2, claim)) == 2
    copy = asyncio.get_running_loop().create_future()  # settled below
    runner._settle_then_release(op, copy)
    [settling] = runner._settling
    await asyncio.sleep(0)  # (it waits on the copy)
    assert not op.payload["claims"] and mgr.allocator(Tier.L1).num_private() == 2, "freed before the copy settled"
    settling.cancel()
    for _ in range(3):
        await asyncio.sleep(0)
    assert not settling.done() and mgr.allocator(Tier.L1).num_private() == 2, "freed while the copy still runs"
    copy.set_result(None)
    await asyncio.wait_for(asyncio.gather(settling, return_exceptions=True), 20)
    assert settling.cancelled()
    assert mgr.allocator(Tier.L1).num_private() == 0, "the cancelled settling leaked the op's pages"
    assert not runner._settling
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_suspect_drop_stops_only_the_restores_of_its_prefix():
    mgr = make_manager(storage_pages=0)
    suspect, other = tuple(range(100, 116)), tuple(range(500, 516))
    write_prefix(mgr, suspect, seed=1)
    write_prefix(mgr, other, seed=2)
    await mgr.drain()
    want = l1_bytes(mgr, other)
    mgr.tree.evict(Tier.L1, 100)
    release = hold_copies(mgr)
    ops = {t: mgr.runner.start_restore(t, mgr.tree.match(t, touch=False), "l2", f"r{t[0]}") for t in (suspect, other)}
    await asyncio.sleep(0)  # (each driver awaits its held copy)
    assert all(op.state is OpState.H2D_PENDING for op in ops.values()), [op.state for op in ops.values()]
    drop_suspect_prefix(mgr, suspect)
    assert ops[suspect].payload["cancel"] and not ops[other].payload["cancel"]
    release.set()
    await asyncio.wait_for(mgr.drain(), 20)
    assert ops[suspect].state is OpState.CANCELLED and ops[other].succeeded
    assert mgr.tree.match(suspect, touch=False).lengths == [0, 0, 0]
    assert torch.equal(l1_bytes(mgr, other), want)
    assert mgr.metrics.cancellations == 1
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_cancelling_no_op_or_an_ended_one_changes_nothing():
    mgr = make_manager(storage_pages=0)
    tokens = tuple(range(16))
    write_prefix(mgr, tokens)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 100)
    op = mgr.runner.start_restore(tokens, mgr.tree.match(tokens, touch=False), "l2", "r")
    await mgr.drain()
    assert op.succeeded
    mgr.runner.cancel(None)
    mgr.runner.cancel(op)
    assert op.succeeded and not op.payload["cancel"] and mgr.metrics.cancellations == 0
    assert mgr.tree.match(tokens, touch=False).lengths[Tier.L1] == 16
    assert_whole(mgr)
    await mgr.close()

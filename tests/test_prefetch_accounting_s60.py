"""An L3 prefetch's accounting. The counters of its ends (`prefetches_started`, `_taken`, `_done`), which close the
op counters' identity `OpRunner.check_integrity` checks (regression: prefetches had no started counter, so where one
was cancelled or failed, the ops counted as ended outnumbered those started). And the two guards session 59's
mutation check left unpinned (survivors S6, S9 of hicache/restores.py): a prefetch whose bytes landed no longer
counts as a storage read in flight (`OpRunner.reading_s`, which the cost model queues a new L3 read behind), and a
take-on to L1 that is refused lets go at once of the L1 lock it took (`OpRunner.take_to_l1`), not when its op
ends. Then four that session 60's check left (S16-S19): what L3's reuse record counts as read, what a take-on needs
L2 to hold, and the locks a taken prefetch and a held restore keep."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import make_manager, toks, until, write_prefix
from test_faults import TransferGate


async def _landed_prefetch(faults: FaultInjector, l1_pages: int = 16, a_in_l1: bool = True,
                           verify_delay_s: float = 0.5):
    """A manager whose first 2 pages (`a`) are in every tier (but L1 unless `a_in_l1`) and whose next 2 (`b`) are
    in L3 only, and a prefetch of `b` whose read lands while its checksums (slowed `verify_delay_s`) still run ->
    (mgr, tokens, op)."""
    mgr = make_manager(l1_pages=l1_pages, host_pages=32, storage_pages=64, faults=faults)
    a = toks((0, 8))
    tokens = a + toks((100, 108))
    write_prefix(mgr, a)
    await mgr.drain()
    write_prefix(mgr, tokens, 8)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 2)  # the leaf `b` leaves L1 and L2; `a` stays
    mgr.tree.evict(Tier.L2, 2)
    if not a_in_l1:
        mgr.tree.evict(Tier.L1, 2)
    m = mgr.match(tokens)
    assert m.lengths == [8 if a_in_l1 else 0, 8, 16]
    faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=verify_delay_s)
    op = mgr.runner.start_restore(tokens, m, "prefetch", "r", take_soon=True)
    assert op is not None
    return mgr, tokens, op


@pytest.mark.asyncio
async def test_a_landed_read_is_no_longer_priced_as_a_read_in_flight():
    """While a prefetch's bytes are on their way, `reading_s` prices them; once they landed (its checksums still
    running), a new L3 read no longer queues behind them, so they are not priced (counting every live L3 read
    would have the cost model recompute prefixes a free storage line could restore)."""
    faults = FaultInjector()
    faults.arm(Fault.SLOW_READ, delay_s=0.2)
    mgr, tokens, op = await _landed_prefetch(faults)
    assert op.state is OpState.S2H_PENDING and mgr.runner.reading_s() > 0
    await until(lambda: op.state is OpState.S2H_LANDED, 10)
    assert mgr.runner.reading_s() == 0.0
    await mgr.drain()
    mgr.check_integrity()
    await mgr.close()


@pytest.mark.asyncio
async def test_a_refused_take_on_unlocks_its_l1_prefix_at_once():
    """A landed prefetch its request cannot take on to L1 (no L1 page free) leaves the op as it was: the lock
    `take_to_l1` took on the L1 prefix goes at once, so that prefix stays evictable while the op verifies its
    checksums, and the op still publishes its read in L2."""
    faults = FaultInjector()
    mgr, tokens, op = await _landed_prefetch(faults, l1_pages=4)
    await until(lambda: op.state is OpState.S2H_LANDED, 10)
    m = mgr.tree.match(tokens, include_storage=False, touch=False)
    a_node = m.handles[Tier.L1]
    locks_before, op_locks_before = a_node.locks[Tier.L1], list(op.payload["locks"])
    claim = mgr.new_claim("squatter")
    assert mgr.alloc_l1(2, claim) is not None  # the two L1 pages `a` does not hold
    assert not mgr.runner.take_to_l1(op, m, tail_tokens=1)
    assert a_node.locks[Tier.L1] == locks_before and op.payload["locks"] == op_locks_before
    assert op.state is OpState.S2H_LANDED
    mgr.release_claim(claim)
    await mgr.drain()
    assert op.state is OpState.L2_L3
    assert mgr.tree.match(tokens, touch=False).lengths == [8, 16, 16]
    mgr.check_integrity()
    await mgr.close()


def _prefetch_counts(mgr) -> tuple[int, ...]:
    m = mgr.metrics
    return (m.prefetches_started, m.prefetches_taken, m.prefetches_done, m.restores_started, m.restores_done)


@pytest.mark.asyncio
@pytest.mark.parametrize("taken", [False, True])
async def test_a_prefetch_is_counted_as_it_starts_and_once_as_it_ends(taken):
    """A prefetch no request takes on ends published in L2 (`prefetches_done`); one taken on to L1 ends as a
    restore (`prefetches_taken`, then a restore started and done). Either way the op counters add up."""
    faults = FaultInjector()
    mgr, tokens, op = await _landed_prefetch(faults)
    assert _prefetch_counts(mgr) == (1, 0, 0, 0, 0)
    await until(lambda: op.state is OpState.S2H_LANDED, 10)
    if taken:
        assert mgr.runner.take_to_l1(op, mgr.tree.match(tokens, include_storage=False, touch=False), tail_tokens=1)
        mgr.runner.release_held(op)
    mgr.check_integrity()  # (running ops count as neither ended nor missing)
    await mgr.drain()
    assert _prefetch_counts(mgr) == ((1, 1, 0, 1, 1) if taken else (1, 0, 1, 0, 0))
    mgr.check_integrity()
    await mgr.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["cancelled", "failed"])
async def test_a_cancelled_or_failed_prefetch_keeps_the_op_counters_whole(end):
    """A prefetch cancelled (its request aborted) or failed (an unreadable page) counts in `cancellations` or
    `failures` and in no other end; `check_integrity` holds after it (it raised before `prefetches_started`)."""
    faults = FaultInjector()
    if end == "failed":
        faults.arm(Fault.EIO_READ)
    mgr, tokens, op = await _landed_prefetch(faults)
    if end == "cancelled":
        mgr.runner.cancel(op)
    await mgr.drain()
    m = mgr.metrics
    assert _prefetch_counts(mgr) == (1, 0, 0, 0, 0)
    assert (m.cancellations, m.op_failures()) == ((1, 0) if end == "cancelled" else (0, 1))
    mgr.check_integrity()
    await mgr.close()


# -- what a landed read and a restore hold (session 60's mutation check: S16-S19 of hicache/restores.py) ---------
@pytest.mark.asyncio
async def test_l3_reuse_counts_the_pages_read_not_those_l2_already_held():
    """A prefetch of a prefix whose first half L2 held reads only the second half: L3's reuse record (what admits
    L3 writes, `hicache/reuse.py`) counts those 2 pages, not the op's 4."""
    faults = FaultInjector()
    mgr, tokens, op = await _landed_prefetch(faults, a_in_l1=False)
    assert op.num_pages == 4 and op.payload["num_read_pages"] == 2
    before = mgr.reuse[Tier.L3].read_pages
    await mgr.drain()
    assert mgr.reuse[Tier.L3].read_pages - before == 2
    await mgr.close()


@pytest.mark.asyncio
async def test_a_take_on_needs_l2_to_hold_what_lies_below_the_read():
    """`take_to_l1` copies L2's pages [l1, l2_start) with the read's: given a match whose L2 ends short of where the
    read starts, it refuses and changes nothing (it would have copied too few pages)."""
    faults = FaultInjector()
    mgr, tokens, op = await _landed_prefetch(faults, a_in_l1=False)
    await until(lambda: op.state is OpState.S2H_LANDED, 10)
    short = mgr.tree.match(tokens[:4], include_storage=False, touch=False)
    assert short.lengths[:2] == [0, 4]
    locks = list(op.payload["locks"])
    assert not mgr.runner.take_to_l1(op, short, tail_tokens=1)
    assert op.state is OpState.S2H_LANDED and op.payload["locks"] == locks
    await mgr.drain()
    mgr.check_integrity()
    await mgr.close()


@pytest.mark.asyncio
async def test_a_taken_prefetch_keeps_its_published_l2_pages_until_its_copy_ends():
    """A prefetch taken on to L1 publishes its L2 pages once verified, while its H2D may still read them: it locks
    them until the op ends, so no eviction frees them under the copy."""
    faults = FaultInjector()
    mgr, tokens, op = await _landed_prefetch(faults)
    await until(lambda: op.state is OpState.S2H_LANDED, 10)
    gate = TransferGate(SimpleNamespace(cache=mgr), "h2d")
    assert mgr.runner.take_to_l1(op, mgr.tree.match(tokens, include_storage=False, touch=False), tail_tokens=1)
    await until(lambda: op.state is OpState.H2D_PENDING, 10)  # verified, published in L2; its H2D held back
    mgr.tree.evict(Tier.L2, 10 ** 9)
    assert mgr.tree.match(tokens, include_storage=False, touch=False).lengths[Tier.L2] == 16
    gate.release.set()
    mgr.runner.release_held(op)
    await mgr.drain()
    assert op.state is OpState.L1_L2_L3
    mgr.check_integrity()
    await mgr.close()


@pytest.mark.asyncio
async def test_a_held_restore_keeps_its_l1_pages_locked_until_released():
    """A restore whose request runs its forward on the pages (`hold_published`) keeps them locked once published,
    until the request takes them over (`release_held`): unlocked, admission counted them as room and they could be
    evicted before the request locked them."""
    mgr = make_manager()
    tokens = toks((0, 16))
    write_prefix(mgr, tokens)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 10 ** 9)
    op = mgr.runner.start_restore(tokens, mgr.tree.match(tokens, include_storage=False, touch=False), "l2", "r")
    mgr.runner.hold_published(op)
    await mgr.drain()
    handle = mgr.tree.match(tokens, include_storage=False, touch=False).handles[Tier.L1]
    assert handle.locks[Tier.L1] == 1
    mgr.runner.release_held(op)
    assert handle.locks[Tier.L1] == 0
    mgr.check_integrity()
    await mgr.close()

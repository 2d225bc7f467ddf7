"""Cache-core guards found untested by session 59's mutation check of hicache/ops.py, radix.py, allocator.py,
restores.py, outcomes.py, continuations.py and suspect.py: what a cancelled op records and logs, when an op counts
as succeeded, the NaN drop's page counts and the tiers a repeated drop takes, the tokens a tier holds from the root,
and no restore for a stale match nor a request's own restore taken as one to follow."""
from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from hicache.ops import OpEvent, OpKind, OpState, apply, new_op, states_of, TERMINAL


# -- ops ------------------------------------------------------------------------------------------
def test_a_cancel_with_a_reason_records_it_and_logs_it():
    """A driver cancels with a reason ("driver task cancelled", "suspect prefix"): the op keeps it and its one
    "op" event carries it, as a failure's does (the reason an operator reads in the log)."""
    op = new_op(3, OpKind.RESTORE_L3, num_pages=2, num_bytes=64, now_ns=0)
    apply(op, OpEvent.START, now_ns=1)
    with capture_logs() as logs:
        apply(op, OpEvent.CANCEL, error="suspect prefix", now_ns=2)
    assert op.state is OpState.CANCELLED and op.error == "suspect prefix"
    assert [(e["to_state"], e.get("error")) for e in logs] == [("CANCELLED", "suspect prefix")]


@pytest.mark.parametrize("kind", list(OpKind))
def test_an_op_not_yet_done_has_not_succeeded(kind):
    """`succeeded` is a finished op's verdict: an op between its steps has not succeeded (callers read it to tell a
    failed restore from a done one)."""
    for state in states_of(kind) - TERMINAL[kind]:
        op = new_op(1, kind, num_pages=1, num_bytes=8, now_ns=0)
        op.state = state
        assert not op.done and not op.succeeded, state


# -- suspect --------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_dropped_page_counts_add_up_over_drops():
    """hicache_nan_dropped_pages counts every suspect drop's pages, not the last one's."""
    from hicache.suspect import drop_suspect_prefix
    from hicache_helpers import make_manager, write_prefix

    mgr = make_manager()
    first, second = tuple(range(8)), tuple(range(100, 112))
    write_prefix(mgr, first)
    write_prefix(mgr, second)
    await mgr.drain()
    a, _ = drop_suspect_prefix(mgr, first)
    b, _ = drop_suspect_prefix(mgr, second)
    assert a["l1"] == 2 and b["l1"] == 3
    assert {k: v for k, v in mgr.metrics.nan_dropped_pages.items() if v} == {
        label: a.get(label, 0) + b.get(label, 0) for label in set(a) | set(b)}
    mgr.check_integrity()
    await mgr.close()


@pytest.mark.asyncio
async def test_a_drop_run_again_as_an_op_lets_go_takes_only_the_tiers_it_held():
    """The drop `stop_backups_of` / `stop_restores_of` run again once an op holding the prefix ends goes only
    through the tiers that op held: a copy no op held (kept because a request locked it, or a clean one published
    since) is not taken with it."""
    from hicache.radix import Tier
    from hicache.suspect import drop_suspect_prefix
    from hicache_helpers import make_manager, write_prefix

    mgr = make_manager()
    tokens = tuple(range(8))
    write_prefix(mgr, tokens)
    await mgr.drain()
    m = mgr.tree.match(tokens, touch=False)
    assert m.lengths == [8, 8, 8]
    for tier in Tier:  # everything locked: the first drop keeps all of it
        mgr.tree.lock(m.handles[tier], tier)
    agains = []
    mgr.runner.stop_backups_of = lambda path, then: agains.append(then)
    dropped, kept = drop_suspect_prefix(mgr, tokens)
    assert dropped == {} and kept == 8 and len(agains) == 1
    for tier in Tier:
        mgr.tree.unlock(m.handles[tier], tier)
    agains[0](frozenset({Tier.L3}))  # (an op that held the prefix in L3 alone ended)
    assert mgr.tree.match(tokens, touch=False).lengths == [8, 8, 0]
    mgr.check_integrity()
    await mgr.close()


# -- radix ----------------------------------------------------------------------------------------
def test_resident_tokens_stops_at_the_first_node_the_tier_does_not_hold():
    """`resident_tokens` (lpm's queue order) counts what the tier holds: a prefix L1 evicted, still in L2, is 0
    tokens of L1 and all of L2's."""
    from hicache.allocator import PageAllocator
    from hicache.radix import RadixTree, Tier

    allocs = {Tier.L1: PageAllocator(8, "l1"), Tier.L2: PageAllocator(8, "l2")}
    tree = RadixTree(4, allocs)
    tokens = tuple(range(8))
    for tier, alloc in allocs.items():
        claim = alloc.new_claim("w")
        tree.insert(tokens, tier, alloc.alloc(2, claim), claim)
    assert tree.evict(Tier.L1, 2) == 2
    assert tree.resident_tokens(tokens, Tier.L1) == 0 and tree.resident_tokens(tokens, Tier.L2) == 8
    tree.check_integrity()


# -- restores -------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_no_restore_for_a_stale_match_and_none_followed_for_its_own_request():
    """A restore of nothing (L2 holds no more than L1) is not made; and a live restore is one for other requests
    to wait for, never for its own (it would wait for itself)."""
    from hicache.radix import Tier
    from hicache_helpers import make_manager, write_prefix

    mgr = make_manager()
    tokens = tuple(range(8))
    write_prefix(mgr, tokens)
    await mgr.drain()
    m = mgr.tree.match(tokens, include_storage=False, touch=False)
    assert m.lengths[:2] == [8, 8]
    assert mgr.runner.start_restore(tokens, m, "l2", "r") is None and mgr.metrics.restores_started == 0
    mgr.tree.evict(Tier.L1, 100)
    m = mgr.tree.match(tokens, include_storage=False, touch=False)
    op = mgr.runner.start_restore(tokens, m, "l2", "r")
    assert op is not None
    assert mgr.runner.restore_in_flight(tokens, m, "r") is None
    assert mgr.runner.restore_in_flight(tokens, m, "q") is op
    await mgr.drain()
    mgr.check_integrity()
    await mgr.close()

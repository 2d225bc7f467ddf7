"""Guards for four rules that session 55's mutation checks could break without any test failing
(each test here was seen failing with its rule put back wrong, and passing as the code is):

- a request parked on its own prefetch keeps for the read's H2D only the L1 room that is left
  (`Restoring._read_room_pages`), never more than L1 holds;
- a prefetch's decision at queue time counts no restore skip (`CostPolicy.decide`, lookahead): a
  declined L3 hit is one skip, counted as its request is admitted;
- a request waits for another's prefetch only if that read brings a page it lacks beyond what L1
  and L2 hold (`OpRunner.restore_in_flight`);
- under write_back a leaf whose backup failed, and that nothing used since, goes unsaved, also when
  the failure came at the very tick of its last use (`Backups.write_back_keep`)."""
from __future__ import annotations

import random

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.linear_cost import LinearCost
from hicache.radix import Tier
from hicache.restores import RESTORE_KINDS
from hicache_helpers import ReadGate, assert_whole, finish, make_manager, toks, until, write_prefix
from scheduler.request import RequestState, SamplingParams
from test_faults import PROMPT, REUSABLE, only_in_l3, reference, run_one
from test_faults import make_engine as make_l3_engine
from test_restore_bookkeeping_hunt import VOCAB, HeldReads, make_engine, prefix_in_l3, results


@pytest.mark.asyncio
async def test_a_request_parked_on_its_prefetch_keeps_no_more_room_than_l1_has():
    """L1 32 pages; a request of 60 + 40 - 1 tokens runs and reserves (decode_reserve_ratio 1) all but 7 of the
    pages free or evictable. The next request's 8-page prefix is read from L3 (its prefetch, held): parked on it,
    the request keeps the 7 pages left for the read's H2D, not the 8 it would take, which would
    promise L1 a page it does not have (room below 0)."""
    rng = random.Random(7)
    prefix = [rng.randrange(VOCAB) for _ in range(32)]
    hog = [rng.randrange(VOCAB) for _ in range(60)]
    eng = make_engine(num_pages=32, prefetch=True, decode_reserve_ratio=1.0)
    await eng.start()
    await prefix_in_l3(eng, prefix)
    gate = HeldReads(eng.cache.store)
    running = eng.add_request(hog, SamplingParams(max_tokens=40, ignore_eos=True))
    await until(lambda: running.output)
    room_pages = eng.admission._l1_room_pages()
    assert 0 < room_pages < len(prefix) // 4, room_pages
    parked = eng.add_request(prefix + [3], SamplingParams(max_tokens=4))
    assert parked.prefetch_op is not None
    await until(lambda: parked.state is RequestState.PARKED)
    assert parked.reserved_pages == room_pages
    assert eng.admission._l1_room_pages() == 0
    gate.release()
    out = await results([running, parked])
    assert out[1].output_ids == await reference(prefix + [3], 4)
    assert out[1].cached_tokens["l3"] == len(prefix)
    assert eng.admission.reserved_pages == 0
    await finish(eng)


@pytest.mark.asyncio
async def test_an_l3_hit_declined_at_queue_time_and_at_admission_counts_one_skip():
    """Policy cost, storage reads priced at 1 ms a byte, no probes: the prompt's L3 hit is declined
    by its prefetch's decision as it is queued and again as it is admitted; it is one recomputed
    hit, one `policy_skips["restore"]`."""
    eng = make_l3_engine(policy="cost", prefetch=True, restore_explore_every=0, host_explore_transfers=0,
                         storage_explore_reads=0)
    await eng.start()
    await run_one(eng)
    await eng.cache.drain()
    only_in_l3(eng, PROMPT[:REUSABLE])
    eng.cache.cost.directions["s2h"] = LinearCost(1e-3)
    out = await run_one(eng)
    assert out.output_ids == await reference(PROMPT)
    m = eng.metrics()
    assert out.cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
    assert m["directions"]["s2h"]["count"] == 0
    assert m["policy_skips"]["restore"] == 1, m["policy_skips"]
    await finish(eng)


@pytest.mark.asyncio
async def test_a_prefetch_is_followed_only_for_pages_beyond_what_l2_holds():
    """A prefetch of p + a (p in L2, a in L3 only) lands in L2. A request for p + b holds p in L2
    already and lacks only b, which that read does not bring: it does not wait for it. One for
    p + a + more does."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64)
    p = toks((0, 8))
    a, b = p + toks((100, 108)), p + toks((200, 208))
    write_prefix(mgr, p)
    await mgr.drain()
    write_prefix(mgr, a, start=len(p))
    await mgr.drain()
    mgr.tree.evict(Tier.L1, mgr.l1.num_pages)
    mgr.tree.evict(Tier.L2, 2)  # a's own 2 pages: the LRU leaf
    match_a = mgr.tree.match(a, touch=False)
    assert match_a.lengths == [0, 8, 16]
    gate = ReadGate(mgr.store)
    op = mgr.runner.start_restore(a, match_a, "prefetch", "a")
    match_b = mgr.tree.match(b, touch=False)
    assert match_b.lengths == [0, 8, 8]
    assert mgr.runner.restore_in_flight(b, match_b, "b", RESTORE_KINDS) is None
    longer = a + toks((300, 304))
    assert mgr.runner.restore_in_flight(longer, mgr.tree.match(longer, touch=False), "c", RESTORE_KINDS) is op
    gate.release()
    await mgr.drain()
    assert mgr.tree.match(a, touch=False).lengths == [0, 16, 16]
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_write_back_evicts_unsaved_a_leaf_whose_backup_failed_at_its_last_use():
    """L1 of 4 pages holds a (2 pages, stamped at the tree's latest tick); a write of c (4 pages)
    must evict it: a's backup starts and fails at that same tick. The next try evicts a unsaved
    rather than back it up again (while every copy fails, each retry would start another)."""
    faults = FaultInjector()
    mgr = make_manager(l1_pages=4, host_pages=8, storage_pages=0, write_policy="write_back", faults=faults)
    a, c = toks((0, 8)), toks((200, 216))
    write_prefix(mgr, a)
    faults.arm(Fault.TRANSFER_RAISE, times=None)  # every copy fails
    assert write_prefix(mgr, c) is None  # (the eviction waits for a's backup)
    await mgr.drain()
    assert mgr.metrics.failures == {"transfer": 1}
    assert mgr.tree.tick == mgr.tree.match(a, touch=False).handles[Tier.L1].stamp[Tier.L1]
    assert write_prefix(mgr, c) is not None
    await mgr.drain()
    assert mgr.metrics.failures == {"transfer": 1}
    assert [mgr.tree.match(x, touch=False).lengths for x in (a, c)] == [[0, 0, 0], [16, 0, 0]]
    assert_whole(mgr)

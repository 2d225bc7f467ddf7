"""Invariants of the core that no test checked (session 55's mutation check: each line below could be changed, and
every test passed). Each test here fails on that mutant and says which line it guards.

- admission.py `release`: a request ending before its max_tokens gives its unused L1 reservation back;
- restores.py `_h2d_step`: an overlapped L2 restore holds the L1 pages it published for its request until adopted;
- manager.py `alloc_pages`: an allocation that cannot fit evicts nothing;
- cost_policy.py `declines_restore`: a request with no hit beyond L1 declines no restore;
- restores.py: an L2 restore counts as an L2 read (write admission) and its time in `restore_s`;
- radix.py `insert(stamp_from=...)`: a backup never makes a node's LRU stamp older;
- allocator.py: best fit where one run holds the request, else the fewest runs, longest first."""
from __future__ import annotations

import asyncio

import pytest

from hicache.allocator import PageAllocator
from hicache.radix import RadixTree, Tier
from hicache_helpers import capture_op_logs, make_manager, write_prefix
from scheduler.request import SamplingParams
from test_faults import OTHER, PROMPT, REUSABLE, finish, make_engine, reference, run_one
from test_restore_overlap import _prefix_only_in_l2


@pytest.mark.asyncio
async def test_a_request_stopping_early_gives_its_unused_reservation_back():
    """(Without it every early stop leaked reserved pages, and after a few nothing more was admitted.)"""
    eng = make_engine(num_pages=48)
    await eng.start()
    want = await reference(PROMPT, 8)
    params = SamplingParams(max_tokens=40, stop_token_ids=[want[1]])  # (stops at its 2nd token of 40)
    for _ in range(4):
        [out] = await eng.generate_async([PROMPT], params)
        assert out.finish_reason == "stop"
        assert not eng.running and eng.admission.reserved_pages == 0
    await finish(eng)


@pytest.mark.parametrize("evict", [False, True])
@pytest.mark.asyncio
async def test_an_overlapped_restore_holds_its_published_pages_until_its_request_adopts_them(evict):
    """(Unheld, an eviction in that window, another request's allocation, lost them: the forward that ran behind
    the restore was discarded and the request never finished.)"""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    await _prefix_only_in_l2(eng)
    adopt, seen = eng.admission.adopt_restored, {}

    def adopted(req):
        op = req.overlap_op
        if op is not None and op.succeeded:
            tree = eng.cache.tree
            node = tree.match(PROMPT[:op.payload["l1_end"]], include_storage=False, touch=False).handles[Tier.L1]
            seen["locks"] = node.locks[Tier.L1] if node is not None else None
            if evict:  # (what another request's allocation may do in the window)
                tree.evict(Tier.L1, eng.cache.l1.num_pages)
        return adopt(req)
    eng.admission.adopt_restored = adopted
    with capture_op_logs() as logs:
        result = await asyncio.wait_for(run_one(eng), 60)
    assert seen.get("locks", 0) >= 1, seen
    assert result.output_ids == want and eng.stats["restore_overlaps"] == 1
    assert not any(e.get("state") == "restore_overlap_discarded" for e in logs)
    await finish(eng)


def test_an_allocation_that_cannot_fit_evicts_nothing():
    """(Without the check it evicted every unlocked page and then failed anyway: a backup longer than L2 wiped L2.)"""
    mgr = make_manager(l1_pages=16, storage_pages=0, write_policy="write_through_selective")
    a, b = tuple(range(100, 116)), tuple(range(200, 216))  # 4 pages each
    write_prefix(mgr, a)
    write_prefix(mgr, b)
    mgr.lock(mgr.tree.match(b, touch=False).handles[Tier.L1])  # (a running request's)
    claim = mgr.new_claim("big")
    assert mgr.alloc_l1(13, claim) is None  # (8 free + 4 evictable < 13)
    assert mgr.tree.match(a, touch=False).lengths[Tier.L1] == len(a)
    mgr.release_claim(claim)
    mgr.check_integrity()


@pytest.mark.parametrize("policy", ["cost", "always"])
@pytest.mark.asyncio
async def test_a_request_without_a_hit_beyond_l1_declines_no_restore(policy):
    """(Counted on every admission, `policy_skips["restore"]`, hicache's declined-restore metric, read 3 after
    three plain requests.)"""
    eng = make_engine(policy=policy)
    await eng.start()
    await run_one(eng)  # (no hit anywhere)
    await eng.cache.drain()
    await run_one(eng)  # (an L1 hit L2 mirrors under write_through: nothing beyond L1)
    await run_one(eng, OTHER)
    assert eng.cache.metrics.policy_skips["restore"] == 0, eng.cache.metrics.policy_skips
    await finish(eng)


@pytest.mark.asyncio
async def test_an_l2_restore_counts_as_an_l2_read_and_is_timed():
    """(Uncounted, under policy "cost" L2 looked never read back and its backups stopped while it served the hits.)"""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    await _prefix_only_in_l2(eng)
    reads, seconds = eng.cache.reuse[Tier.L2].read_pages, eng.cache.metrics.restore_s
    result = await run_one(eng)
    assert result.output_ids == want and result.cached_tokens["l2"] == REUSABLE
    await eng.cache.drain()
    assert eng.cache.reuse[Tier.L2].read_pages - reads == REUSABLE // eng.cache.page_size
    assert eng.cache.metrics.restore_s > seconds
    await finish(eng)


def _put(tree, allocs, tier, tokens, start=0, stamp_from=None) -> None:
    alloc = allocs[tier]
    claim = alloc.new_claim("c")
    pages = alloc.alloc((len(tokens) - start) // 2, claim)
    alloc.free(tree.insert(tokens, tier, pages, claim, start_tokens=start, stamp_from=stamp_from), claim)
    alloc.close_claim(claim)


def test_a_backup_never_makes_its_prefixs_stamp_older():
    """(A prefix used lately in L2 took the older L1 stamp of a backup passing through it, and L2 evicted it first.)"""
    allocs = {Tier.L1: PageAllocator(16, "l1"), Tier.L2: PageAllocator(16, "l2")}
    tree = RadixTree(2, allocs)
    p, a, x = [1, 2], [3, 4], [9, 9]
    _put(tree, allocs, Tier.L1, p + a)  # (computed long ago: old L1 stamps)
    _put(tree, allocs, Tier.L2, x)  # (in L2, used after that)
    _put(tree, allocs, Tier.L2, p)  # (in L2 later still)
    node = tree.match(p, touch=False).handles[Tier.L2]
    before = node.stamp[Tier.L2]
    _put(tree, allocs, Tier.L2, p + a, start=len(p), stamp_from=Tier.L1)  # (a's backup from L1)
    assert node.stamp[Tier.L2] >= before
    tree.evict(Tier.L2, 2)  # (LRU: a, then x; not p)
    assert tree.match(p, touch=False).lengths[Tier.L2] == len(p)
    tree.check_integrity()


def _fragment(alloc: PageAllocator, claim: int, layout: list[tuple[int, bool]]) -> None:
    """Runs from page 0: (length, freed?)."""
    pages, pos = alloc.alloc(alloc.num_pages, claim), 0
    for length, free in layout:
        if free:
            alloc.free(pages[pos:pos + length], claim)
        pos += length


def test_an_allocation_takes_the_run_that_fits_exactly():
    alloc = PageAllocator(16, "t")
    _fragment(alloc, alloc.new_claim("c"), [(4, True), (1, False), (6, True), (5, False)])
    assert alloc.alloc(4, alloc.new_claim("d")) == [0, 1, 2, 3]  # (not the first 4 of the run of 6)
    alloc.check([])


def test_an_allocation_no_run_holds_takes_the_fewest_runs():
    alloc = PageAllocator(20, "t")
    _fragment(alloc, alloc.new_claim("c"), [(1, True), (1, False), (2, True), (1, False), (6, True), (9, False)])
    got = alloc.alloc(7, alloc.new_claim("d"))
    assert 1 + sum(b != a + 1 for a, b in zip(got, got[1:])) == 2, got  # (the 6, then one of the others)
    alloc.check([])


@pytest.mark.asyncio
async def test_write_through_selective_backs_up_a_prefix_on_its_second_hit_not_its_first():
    mgr = make_manager(l1_pages=16, storage_pages=0, write_policy="write_through_selective")
    a = tuple(range(100, 116))
    write_prefix(mgr, a)  # (computed: no backup under this policy)
    for hit, l2_tokens in ((1, 0), (2, len(a))):
        mgr.note_hit(a, mgr.match(a))
        await mgr.drain()
        assert mgr.tree.match(a, touch=False).lengths[Tier.L2] == l2_tokens, hit
    mgr.check_integrity()
    await mgr.close()

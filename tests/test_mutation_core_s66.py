"""Cache-core rules found unwatched by session 66's mutation check of hicache/radix.py, restores.py and
operations.py. The radix tree: what it refuses before it changes anything (an insert from an unaligned start or
with a wrong page count, a publication of nothing over tokens the tier does not hold, a lock on a node the tier
does not hold, a drop of a locked node), and a match told not to split leaves the tree as it was. The restores: no
L3 read for what L1 holds, only short reads taken on hold their checksums for the launch, and a take-on is refused
once L1 grew into the read, keeps no L1 claim when refused, and locks the L1 head that grew since the prefetch
started. The drivers: a corrupt page another read still locks is left for that read's failure to drop, and no
driver raises on it."""
from __future__ import annotations

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import assert_whole, flip_l3_byte, make_manager, toks, until, write_prefix
from test_prefetch_accounting_s60 import _landed_prefetch
from test_radix import make_tree, put


# -- radix ----------------------------------------------------------------------------------------
def test_a_match_told_not_to_split_stops_before_a_node_it_only_partly_matches():
    """split=False (suspect drops and the L3 index read the tree with it): a prompt leaving a node midway matches
    up to that node only, and the node stays whole (a read that must not reshape the tree)."""
    tree, allocs = make_tree()
    a = list(range(16))
    put(tree, allocs, a)
    m = tree.match(a[:8] + [99] * 4, split=False)
    assert m.lengths[Tier.L1] == 0 and m.path == []
    assert [len(n.key) for n in tree.iter_nodes() if n is not tree.root] == [16]
    assert tree.match(a[:8] + [99] * 4).lengths[Tier.L1] == 8  # (a splitting match finds the shared half)
    tree.check_integrity()


def test_an_insert_from_an_unaligned_start_is_refused_before_it_changes_anything():
    """start_tokens must be page aligned: an insert from inside a page is refused outright, not published from the
    next node on with pages counted from the wrong token."""
    tree, allocs = make_tree()
    a = list(range(12))
    put(tree, allocs, a[:8])
    claim = allocs[Tier.L1].new_claim("t")
    pages = allocs[Tier.L1].alloc(1, claim)  # (12 - 6) // 4 == 1
    with pytest.raises(ValueError, match="page aligned"):
        tree.insert(a, Tier.L1, pages, claim, start_tokens=6)
    assert tree.match(a).lengths[Tier.L1] == 8
    allocs[Tier.L1].free(pages, claim)
    allocs[Tier.L1].close_claim(claim)
    tree.check_integrity()


def test_an_insert_with_a_page_count_unlike_its_tokens_is_refused():
    """Three pages for two pages of tokens: refused (the third would stay private and uncounted, neither in the
    tree nor handed back as a duplicate)."""
    tree, allocs = make_tree()
    a = list(range(8))
    claim = allocs[Tier.L1].new_claim("t")
    pages = allocs[Tier.L1].alloc(3, claim)
    with pytest.raises(ValueError, match="3 pages for 8 tokens"):
        tree.insert(a, Tier.L1, pages, claim)
    assert not tree.root.children
    allocs[Tier.L1].free(pages, claim)
    allocs[Tier.L1].close_claim(claim)
    tree.check_integrity()


def test_publishing_no_pages_over_tokens_the_tier_does_not_hold_is_refused_and_leaves_no_node():
    """An insert whose start is the end of its tokens publishes nothing, but what precedes it must be resident
    there: refused when it is not, and the node the walk made for those tokens goes again (no empty leaf)."""
    tree, allocs = make_tree()
    a = list(range(8))
    claim = allocs[Tier.L2].new_claim("t")
    with pytest.raises(ValueError, match="not resident in L2"):
        tree.insert(a, Tier.L2, [], claim, start_tokens=8)
    assert not tree.root.children
    tree.check_integrity()
    put(tree, allocs, a, Tier.L1)  # in the tree, but L1's only
    with pytest.raises(ValueError, match="not resident in L2"):
        tree.insert(a, Tier.L2, [], claim, start_tokens=8)
    allocs[Tier.L2].close_claim(claim)
    tree.check_integrity()


def test_locking_a_node_the_tier_does_not_hold_is_refused_as_such():
    """A lock protects a tier's pages: on a node that tier does not hold it is a caller's error, refused with what
    is wrong (not a TypeError from counting pages it has none of), and no count changes."""
    tree, allocs = make_tree()
    a = list(range(8))
    put(tree, allocs, a, Tier.L1)
    node = tree.match(a).handles[Tier.L1]
    with pytest.raises(ValueError, match="not resident in L2"):
        tree.lock(node, Tier.L2)
    assert node.locks == [0, 0, 0] and tree.num_locked_pages == [0, 0, 0]
    tree.check_integrity()


def test_dropping_a_locked_node_is_refused_and_leaves_it_whole_and_resident():
    """A lock protects transfer sources and running requests' prefixes: drop (a corrupt or vanished page) refuses a
    locked node, from its first page or from a later one, before it splits it or frees a page."""
    tree, allocs = make_tree()
    a = list(range(16))
    put(tree, allocs, a, Tier.L3)
    node = tree.match(a).handles[Tier.L3]
    tree.lock(node, Tier.L3)
    for from_pages in (0, 2):
        with pytest.raises(ValueError, match="locked in L3"):
            tree.drop(node, Tier.L3, from_pages=from_pages)
        assert [len(n.key) for n in tree.iter_nodes() if n is not tree.root] == [16]
        assert tree.match(a).lengths[Tier.L3] == 16 and tree.num_resident_pages[Tier.L3] == 4
        tree.check_integrity()
    tree.unlock(node, Tier.L3)
    assert len(tree.drop(node, Tier.L3, from_pages=2)) == 2
    assert tree.match(a).lengths[Tier.L3] == 8
    tree.check_integrity()


# -- restores -------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("source", ["l3", "prefetch"])
async def test_no_storage_read_for_a_prefix_l1_holds_though_l2_does_not(source):
    """L1 holds the whole prefix, L3 too, L2 none of it (its L2 copy evicted): an L3 restore or prefetch would copy
    nothing L1 lacks, so none is made and nothing is read (the bound is what L1 or L2 holds, whichever is more)."""
    mgr = make_manager()
    b = toks((0, 16))
    write_prefix(mgr, b)
    await mgr.drain()
    assert mgr.tree.evict(Tier.L2, 100) == 4
    m = mgr.tree.match(b, touch=False)
    assert m.lengths == [16, 0, 16]
    assert mgr.runner.start_restore(b, m, source, "r") is None
    assert not mgr.runner.live and mgr.metrics.restores_started + mgr.metrics.prefetches_started == 0
    await mgr.drain()
    assert_whole(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("hold_max_pages,held", [(2, True), (1, False)])
async def test_only_a_short_read_taken_on_holds_its_checksums_for_the_launch(hold_max_pages, held, monkeypatch):
    """A prefetch to be taken on soon verifies after its landing; only a read up to HOLD_CHECKS_MAX_BYTES holds its
    checksums until the forward's launch (`hold_checks`), a longer one starts them at the landing (its hashing
    outlasts that forward: held, it would delay the restore)."""
    import hicache.restores as restores_mod
    from hicache.storage import FileStore
    reads = []
    read_pages = FileStore.read_pages

    def spy(self, *args, **kwargs):
        reads.append(kwargs)
        return read_pages(self, *args, **kwargs)
    monkeypatch.setattr(FileStore, "read_pages", spy)
    page_bytes = make_manager(storage_pages=0).geometry.bytes_per_page
    monkeypatch.setattr(restores_mod, "HOLD_CHECKS_MAX_BYTES", hold_max_pages * page_bytes)
    mgr, tokens, op = await _landed_prefetch(FaultInjector())
    assert op.payload["num_read_pages"] == 2
    assert [(r.get("hold_checks", False), r.get("checksums_after_landing", False)) for r in reads] == \
        [(held, not held)]
    await mgr.drain()
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_prefetch_is_not_taken_on_once_l1_holds_part_of_what_it_read():
    """Between the landing and the take-on a request computed the first page the prefetch read: L1 now holds past
    where the read starts, the L1 pages would not line up with the op's L2 ones, so the take-on is refused with
    nothing changed, and the read is still published in L2."""
    # (its checks slowed 2 s, as in the next test: they outlast the test's steps on a loaded machine)
    mgr, tokens, op = await _landed_prefetch(FaultInjector(), verify_delay_s=2.0)
    await until(lambda: op.state is OpState.S2H_LANDED, 10)
    assert write_prefix(mgr, tokens[:12], 8) is not None
    m = mgr.tree.match(tokens, include_storage=False, touch=False)
    assert m.lengths[:2] == [12, 8]
    locks = list(op.payload["locks"])
    assert not mgr.runner.take_to_l1(op, m, tail_tokens=1)
    assert op.state is OpState.S2H_LANDED and op.payload["locks"] == locks and Tier.L1 not in op.payload["claims"]
    await mgr.drain()
    assert op.state is OpState.L2_L3 and mgr.tree.match(tokens, touch=False).lengths == [12, 16, 16]
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_refused_take_on_keeps_no_l1_claim_and_a_later_one_leaks_none():
    """A take-on refused for want of L1 pages leaves the op without an L1 claim (nothing changed); taken on later,
    once pages are free, the op ends with every claim it opened closed."""
    mgr, tokens, op = await _landed_prefetch(FaultInjector(), l1_pages=4, verify_delay_s=2.0)
    await until(lambda: op.state is OpState.S2H_LANDED, 10)
    l1 = mgr.allocator(Tier.L1)
    claims_before = len(l1.claim_labels)
    m = mgr.tree.match(tokens, include_storage=False, touch=False)
    squatter = mgr.new_claim("squatter")
    assert mgr.alloc_l1(2, squatter) is not None  # the two L1 pages `a` does not hold
    assert not mgr.runner.take_to_l1(op, m, tail_tokens=1)
    assert Tier.L1 not in op.payload["claims"] and len(l1.claim_labels) == claims_before + 1
    mgr.release_claim(squatter)
    assert mgr.runner.take_to_l1(op, m, tail_tokens=1)
    await mgr.drain()
    assert mgr.tree.match(tokens, touch=False).lengths == [16, 16, 16]
    assert len(l1.claim_labels) == claims_before
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_take_on_keeps_the_l1_prefix_that_grew_since_the_prefetch_started():
    """The prefetch started with L1 holding none of the prefix; a request computed its head into L1 meanwhile, and
    the take-on's H2D lands after it: the take-on locks that head while it allocates, so the allocation evicts
    another leaf (here the later used one) rather than the head its pages must follow."""
    faults = FaultInjector()
    mgr = make_manager(l1_pages=4, faults=faults)
    a, c = toks((0, 8)), toks((200, 208))
    tokens = a + toks((100, 108))
    write_prefix(mgr, a)
    await mgr.drain()
    write_prefix(mgr, tokens, 8)
    await mgr.drain()
    assert mgr.tree.evict(Tier.L1, 4) == 4 and mgr.tree.evict(Tier.L2, 2) == 2
    write_prefix(mgr, c)
    await mgr.drain()
    m = mgr.match(tokens)
    assert m.lengths == [0, 8, 16]
    faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=1.0)  # (the take-on comes before its checksums end)
    op = mgr.runner.start_restore(tokens, m, "prefetch", "r", take_soon=True)
    await until(lambda: op.state is OpState.S2H_LANDED, 10)
    assert write_prefix(mgr, a) is not None  # L1 full: c, a
    await until(lambda: mgr.runner.pending_counts()["backups"] == 0, 10)
    mgr.match(c)  # c used last: `a` is L1's least recently used leaf
    m = mgr.tree.match(tokens, include_storage=False, touch=False)
    assert m.lengths[:2] == [8, 8]
    assert mgr.runner.take_to_l1(op, m, tail_tokens=1)
    await mgr.drain()
    assert mgr.tree.match(tokens, touch=False).lengths == [16, 16, 16]
    assert mgr.tree.match(c, touch=False).lengths[Tier.L1] == 0
    assert_whole(mgr)
    await mgr.close()


# -- operations -----------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_bad_page_another_read_still_locks_is_left_to_that_reads_failure_to_drop():
    """Two reads of one L3 prefix, one corrupt page: the first to fail finds the page's node locked by the other
    (its source) and leaves it; the other, failing on the same page, drops it from the bad page on. Neither driver
    raises (a drop of a locked node is refused), and the valid pages before the bad one stay in L3."""
    mgr = make_manager()
    a = toks((0, 16))
    write_prefix(mgr, a)
    await mgr.drain()
    assert mgr.tree.evict(Tier.L1, 100) == 4 and mgr.tree.evict(Tier.L2, 100) == 4
    m = mgr.match(a)
    assert m.lengths == [0, 0, 16]
    flip_l3_byte(mgr, m.pages[Tier.L3][2])
    ops = [mgr.runner.start_restore(a, mgr.match(a), "prefetch", f"r{i}") for i in range(2)]
    await mgr.drain()
    assert [op.state for op in ops] == [OpState.FAILED] * 2 and all("checksum" in op.error for op in ops)
    assert mgr.tree.match(a, touch=False).lengths == [0, 0, 8]
    assert_whole(mgr)
    await mgr.close()

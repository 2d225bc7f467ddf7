import random

import pytest

from hicache.allocator import PageAllocator
from hicache.radix import RadixTree, Tier


def make_tree(page_size=4, pages=64):
    allocs = {t: PageAllocator(pages, t.label) for t in (Tier.L1, Tier.L2, Tier.L3)}
    return RadixTree(page_size, allocs), allocs


def put(tree, allocs, tokens, tier=Tier.L1, start=0):
    claim = allocs[tier].new_claim("test")
    pages = allocs[tier].alloc((len(tokens) - start) // tree.page_size, claim)
    dups = tree.insert(tokens, tier, pages, claim, start_tokens=start)
    allocs[tier].free(dups, claim)
    allocs[tier].close_claim(claim)
    return pages, dups


def test_match_is_page_aligned_and_splits():
    tree, allocs = make_tree()
    a = list(range(16))
    put(tree, allocs, a)
    m = tree.match(a[:10] + [99])
    assert m.lengths[Tier.L1] == 8
    assert len(m.pages[Tier.L1]) == 2
    tree.check_integrity()
    b = a[:8] + [50, 51, 52, 53]
    _, dups = put(tree, allocs, b)
    assert len(dups) == 2  # the shared 8 tokens were already resident
    assert tree.match(b).lengths[Tier.L1] == 12
    assert tree.match(a).lengths[Tier.L1] == 16
    tree.check_integrity()


def test_tiers_hit_independently_and_evict_per_tier():
    tree, allocs = make_tree()
    a = list(range(16))
    put(tree, allocs, a, Tier.L1)
    put(tree, allocs, a, Tier.L2)
    assert tree.evict(Tier.L1, 100) == 4
    m = tree.match(a)
    assert m.lengths[Tier.L1] == 0 and m.lengths[Tier.L2] == 16
    tree.check_integrity()
    assert tree.evict(Tier.L2, 100) == 4
    assert not tree.root.children  # nothing holds the node: it left the tree
    tree.check_integrity()


def test_lock_protects_from_eviction_and_split_keeps_locks():
    tree, allocs = make_tree()
    a = list(range(16))
    put(tree, allocs, a)
    m = tree.match(a)
    tree.lock(m.handles[Tier.L1], Tier.L1)
    assert tree.evict(Tier.L1, 100) == 0
    tree.match(a[:8] + [7, 7, 7, 7])  # splits the locked node
    tree.check_integrity()
    tree.unlock(m.handles[Tier.L1], Tier.L1)
    assert tree.evict(Tier.L1, 100) == 4
    tree.check_integrity()


def test_contiguity_enforced_on_insert():
    tree, allocs = make_tree()
    a = list(range(16))
    claim = allocs[Tier.L2].new_claim("t")
    pages = allocs[Tier.L2].alloc(2, claim)
    with pytest.raises(ValueError):
        tree.insert(a, Tier.L2, pages, claim, start_tokens=8)  # [0, 8) not resident in L2
    allocs[Tier.L2].free(pages, claim)
    tree.check_integrity()


def test_insert_with_start_extends_residency():
    tree, allocs = make_tree()
    a = list(range(16))
    put(tree, allocs, a[:8], Tier.L2)
    put(tree, allocs, a, Tier.L2, start=8)
    assert tree.match(a).lengths[Tier.L2] == 16
    tree.check_integrity()


def test_integrity_detects_double_page():
    tree, allocs = make_tree()
    put(tree, allocs, list(range(8)))
    node = next(iter(tree.root.children.values()))
    node.pages[Tier.L1][1] = node.pages[Tier.L1][0]
    with pytest.raises(AssertionError):
        tree.check_integrity()


def test_random_workload_integrity():
    rng = random.Random(0)
    tree, allocs = make_tree(page_size=2, pages=40)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(2, 12))] for _ in range(6)]
    for step in range(300):
        toks = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
        toks = toks[: len(toks) - len(toks) % 2]
        tier = rng.choice([Tier.L1, Tier.L2])
        m = tree.match(toks)
        start = m.lengths[tier]
        need = (len(toks) - start) // 2
        if allocs[tier].num_free < need:
            tree.evict(tier, need - allocs[tier].num_free)
            m = tree.match(toks)
            start = m.lengths[tier]
            need = (len(toks) - start) // 2
        if allocs[tier].num_free >= need:
            put(tree, allocs, toks, tier, start=start)
        tree.check_integrity()

"""The page allocator's indexes (free runs, per-claim page sets) against its owner table: random
operation sequences keep them in agreement (`check()`), and every allocation follows the rule:
best fit when one free run holds the request, else the fewest runs."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.allocator import FREE, AllocatorError, PageAllocator


def free_runs(alloc: PageAllocator) -> list[tuple[int, int]]:
    """(start, length) of every maximal free run, from the owner table."""
    free = np.flatnonzero(alloc.owner == FREE)
    if not len(free):
        return []
    breaks = np.flatnonzero(np.diff(free) != 1) + 1
    return [(int(r[0]), len(r)) for r in np.split(free, breaks)]


def runs_of(pages: list[int]) -> int:
    return 1 + sum(1 for a, b in zip(pages, pages[1:]) if b != a + 1) if pages else 0


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "publish", "evict"]), st.integers(1, 24),
                         st.integers(0, 10**6)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(1, 64), steps=ops)
def test_indexes_follow_the_owner_table_and_the_fit_rule(num_pages, steps):
    alloc = PageAllocator(num_pages, "t")
    claims = [alloc.new_claim(f"c{i}") for i in range(3)]
    tree: list[int] = []
    for kind, n, pick in steps:
        claim = claims[pick % 3]
        held = alloc.pages_of(claim)
        if kind == "alloc":
            before = free_runs(alloc)
            got = alloc.alloc(n, claim)
            if n > sum(length for _, length in before):
                assert got is None
                continue
            fits = [(length, start) for start, length in before if length >= n]
            if fits:
                _, start = min(fits)
                assert got == list(range(start, start + n))  # best fit, lowest on a tie
            else:
                longest = sorted((length for _, length in before), reverse=True)
                fewest = next(k for k in range(1, len(longest) + 1) if sum(longest[:k]) >= n)
                assert runs_of(got) == fewest
        elif kind == "free" and held:
            alloc.free(held[pick % len(held):][:n], claim)
        elif kind == "publish" and held:
            part = held[:n]
            alloc.give_to_tree(part, claim)
            tree.extend(part)
        elif kind == "evict" and tree:
            part, tree[:] = tree[:n], tree[n:]
            alloc.free_from_tree(part)
        alloc.check(tree)
    for claim in claims:
        alloc.free(alloc.pages_of(claim), claim)
        alloc.close_claim(claim)
    alloc.free_from_tree(tree)
    alloc.check([])
    assert alloc._runs == [(num_pages, 0)]  # everything merged back into one run


def test_bad_moves_change_nothing():
    alloc = PageAllocator(8, "t")
    a, b = alloc.new_claim("a"), alloc.new_claim("b")
    pages = alloc.alloc(4, a)
    for bad in ([pages[0], pages[0]], [pages[0], 99], [pages[0], 7]):  # duplicate, out of range, not a's
        with pytest.raises(AllocatorError):
            alloc.free(bad, a)
    with pytest.raises(AllocatorError):
        alloc.free(pages, b)
    # consecutive runs take a fast path (a slice of the owner table): a run with one page of another
    # owner, and a list that spans as many values as it has entries but repeats one, still fail whole
    other = alloc.alloc(2, b)  # pages 4, 5
    with pytest.raises(AllocatorError, match=r"pages \[4\] owned by"):
        alloc.free([2, 3, 4], a)
    with pytest.raises(AllocatorError, match="duplicate"):
        alloc.free([1, 1, 3], a)
    alloc.free(other, b)
    alloc.check([])
    assert alloc.pages_of(a) == pages and alloc.num_free == 4
    with pytest.raises(AllocatorError):
        alloc.close_claim(a)

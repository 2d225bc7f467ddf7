"""Page allocator for one tier: prefers consecutive runs and records who owns every page.

Every page of a tier is in exactly one of three states, recorded in `owner`:
  FREE      in the allocator's free set,
  TREE      owned by the radix tree (published residency),
  claim id  private to one claim (a running request, or a transfer's destination before publish).
So "tree-owned + free + private = capacity" holds by construction, and `check()` can verify it against
the tree and the set of live claims. Ownership moves only through the methods below.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

FREE = -1
TREE = -2


class AllocatorError(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, name: str) -> None:
        if num_pages < 0:
            raise ValueError(f"{name}: num_pages must be >= 0")
        self.name = name
        self.num_pages = num_pages
        self.owner = np.full(num_pages, FREE, dtype=np.int64)
        self.num_free = num_pages
        self._next_claim = 0
        self.claim_labels: dict[int, str] = {}

    # -- claims -------------------------------------------------------------------------------
    def new_claim(self, label: str) -> int:
        claim = self._next_claim
        self._next_claim += 1
        self.claim_labels[claim] = label
        return claim

    def close_claim(self, claim: int) -> None:
        """Forget a claim; it must hold no pages any more."""
        held = int(np.count_nonzero(self.owner == claim))
        if held:
            raise AllocatorError(f"{self.name}: claim {self.claim_labels.get(claim)} closed holding {held} pages")
        self.claim_labels.pop(claim, None)

    # -- allocation ---------------------------------------------------------------------------
    def alloc(self, num_pages: int, claim: int) -> list[int] | None:
        """Private pages for `claim`, one consecutive run when one exists (best fit), else the
        fewest runs (longest first). None when not enough pages are free."""
        if num_pages <= 0:
            return []
        if claim not in self.claim_labels:
            raise AllocatorError(f"{self.name}: unknown claim {claim}")
        if num_pages > self.num_free:
            return None
        free_idx = np.flatnonzero(self.owner == FREE)
        breaks = np.flatnonzero(np.diff(free_idx) != 1) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [len(free_idx)]))
        lengths = ends - starts
        fits = np.flatnonzero(lengths >= num_pages)
        if len(fits):
            best = fits[np.argmin(lengths[fits])]
            pages = free_idx[starts[best]: starts[best] + num_pages]
        else:
            chosen: list[np.ndarray] = []
            remaining = num_pages
            for run in np.argsort(-lengths, kind="stable"):
                take = min(remaining, int(lengths[run]))
                chosen.append(free_idx[starts[run]: starts[run] + take])
                remaining -= take
                if remaining == 0:
                    break
            pages = np.sort(np.concatenate(chosen))
        self.owner[pages] = claim
        self.num_free -= num_pages
        return pages.tolist()

    def free(self, pages: Sequence[int], claim: int) -> None:
        """Return private pages of `claim` to the free set."""
        self._move(pages, expect=claim, to=FREE)
        self.num_free += len(pages)

    def give_to_tree(self, pages: Sequence[int], claim: int) -> None:
        """Publish private pages: the tree owns them from now on."""
        self._move(pages, expect=claim, to=TREE)

    def take_from_tree(self, pages: Sequence[int], claim: int) -> None:
        """A tree page becomes private again (unused today; kept symmetric for tests)."""
        self._move(pages, expect=TREE, to=claim)

    def free_from_tree(self, pages: Sequence[int]) -> None:
        """Eviction: tree pages go back to the free set."""
        self._move(pages, expect=TREE, to=FREE)
        self.num_free += len(pages)

    def _move(self, pages: Sequence[int], expect: int, to: int) -> None:
        if len(pages) == 0:
            return
        idx = np.asarray(pages, dtype=np.int64)
        if idx.min() < 0 or idx.max() >= self.num_pages:
            raise AllocatorError(f"{self.name}: page index out of range")
        if len(np.unique(idx)) != len(idx):
            raise AllocatorError(f"{self.name}: duplicate pages in one call")
        wrong = idx[self.owner[idx] != expect]
        if len(wrong):
            raise AllocatorError(
                f"{self.name}: pages {wrong[:8].tolist()} owned by {self.owner[wrong[:8]].tolist()}, "
                f"expected {expect}")
        self.owner[idx] = to

    # -- inspection ---------------------------------------------------------------------------
    def pages_of(self, claim: int) -> list[int]:
        return np.flatnonzero(self.owner == claim).tolist()

    def num_private(self) -> int:
        return int(np.count_nonzero(self.owner >= 0))

    def num_tree(self) -> int:
        return int(np.count_nonzero(self.owner == TREE))

    def check(self, tree_pages: Iterable[int]) -> None:
        """Invariant 1 and 4 for this tier: tree pages appear once and are exactly the TREE-owned
        pages; free count agrees; every private page belongs to a live claim."""
        tree = np.fromiter(tree_pages, dtype=np.int64)
        if len(np.unique(tree)) != len(tree):
            raise AssertionError(f"{self.name}: a physical page appears twice in the tree")
        owned = np.flatnonzero(self.owner == TREE)
        if not np.array_equal(np.sort(tree), owned):
            extra = np.setdiff1d(tree, owned)[:8].tolist()
            missing = np.setdiff1d(owned, tree)[:8].tolist()
            raise AssertionError(f"{self.name}: tree pages disagree with allocator: in tree but not owned "
                                 f"{extra}, owned but not in tree {missing}")
        if int(np.count_nonzero(self.owner == FREE)) != self.num_free:
            raise AssertionError(f"{self.name}: free count {self.num_free} disagrees with owner table")
        claims = np.unique(self.owner[self.owner >= 0])
        dead = [int(c) for c in claims if int(c) not in self.claim_labels]
        if dead:
            raise AssertionError(f"{self.name}: pages held by closed claims {dead}")
        total = len(owned) + self.num_free + self.num_private()
        if total != self.num_pages:
            raise AssertionError(f"{self.name}: owned+free+private = {total} != capacity {self.num_pages}")

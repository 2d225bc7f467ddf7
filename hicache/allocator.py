"""Page allocator for one tier: prefers consecutive runs and records who owns every page.

Every page of a tier is in exactly one of three states, recorded in `owner`:
  FREE      in the allocator's free set,
  TREE      owned by the radix tree (published residency),
  claim id  private to one claim (a running request, or a transfer's destination before publish).
So "tree-owned + free + private = capacity" holds by construction, and `check()` can verify it against
the tree and the set of live claims. Ownership moves only through the methods below.

Cost: every operation is proportional to the pages it moves (plus a log of the number of free
runs), never to the tier's size: the free set is kept as runs (a sorted list of (length, start) for
best fit, and start/end maps for merging neighbours on free) and each claim knows its pages. At a
million pages a fragmented allocation used to scan the whole owner table (~20 ms a call); the
owner table remains the referee that `check()` compares everything against. A consecutive run (what
`alloc` hands out when it can) moves through a slice of the table, its owners checked as a Python
list: at a request's ~20 pages numpy's per-call cost is most of the time (publish and evict of 22
pages 16 / 19 -> 10 / 10 µs on the development machine; scripts/bench_allocator.py).
"""
from __future__ import annotations

from bisect import bisect_left, insort
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
        self._held: dict[int, set[int]] = {}       # claim -> its private pages
        self._runs: list[tuple[int, int]] = []     # free runs as (length, start), sorted
        self._run_at: dict[int, int] = {}          # free run start -> length
        self._run_ending: dict[int, int] = {}      # free run end (exclusive) -> start
        if num_pages:
            self._add_run(0, num_pages)

    # -- free runs ------------------------------------------------------------------------------
    def _add_run(self, start: int, length: int) -> None:
        insort(self._runs, (length, start))
        self._run_at[start] = length
        self._run_ending[start + length] = start

    def _remove_run(self, start: int) -> int:
        length = self._run_at.pop(start)
        del self._run_ending[start + length]
        del self._runs[bisect_left(self._runs, (length, start))]
        return length

    def _take(self, start: int, take: int) -> None:
        """Take the first `take` pages of the free run at `start`."""
        length = self._remove_run(start)
        if length > take:
            self._add_run(start + take, length - take)

    def _release_runs(self, pages: list[int]) -> None:
        """Pages (sorted, distinct) become free: add them as runs, merged with free neighbours."""
        first = 0
        for i in range(1, len(pages) + 1):
            if i < len(pages) and pages[i] == pages[i - 1] + 1:
                continue
            self._release_run(pages[first], pages[i - 1] + 1)
            first = i

    def _release_run(self, start: int, end: int) -> None:
        """Pages [start, end) become free: one run, merged with its free neighbours."""
        if start in self._run_ending:
            left = self._run_ending[start]
            self._remove_run(left)
            start = left
        if end in self._run_at:
            end += self._remove_run(end)
        self._add_run(start, end - start)

    # -- claims -------------------------------------------------------------------------------
    def new_claim(self, label: str) -> int:
        claim = self._next_claim
        self._next_claim += 1
        self.claim_labels[claim] = label
        self._held[claim] = set()
        return claim

    def close_claim(self, claim: int) -> None:
        """Forget a claim; it must hold no pages any more."""
        held = len(self._held.get(claim, ()))
        if held:
            raise AllocatorError(f"{self.name}: claim {self.claim_labels.get(claim)} closed holding {held} pages")
        self.claim_labels.pop(claim, None)
        self._held.pop(claim, None)

    # -- allocation ---------------------------------------------------------------------------
    def alloc(self, num_pages: int, claim: int) -> list[int] | None:
        """Private pages for `claim`, one consecutive run when one exists (best fit: the shortest
        run that holds them, the lowest on a tie), else the fewest runs (longest first). None when
        not enough pages are free."""
        if num_pages <= 0:
            return []
        if claim not in self.claim_labels:
            raise AllocatorError(f"{self.name}: unknown claim {claim}")
        if num_pages > self.num_free:
            return None
        i = bisect_left(self._runs, (num_pages, -1))
        if i < len(self._runs):
            start = self._runs[i][1]
            self._take(start, num_pages)
            pages = list(range(start, start + num_pages))
            self.owner[start:start + num_pages] = claim
        else:
            pages, remaining = [], num_pages
            while remaining:
                length, start = self._runs[-1]  # no run holds them all: whole runs, longest first
                take = min(remaining, length)
                self._take(start, take)
                pages.extend(range(start, start + take))
                remaining -= take
            pages.sort()
            self.owner[pages] = claim
        self._held[claim].update(pages)
        self.num_free -= num_pages
        return pages

    def take(self, pages: Sequence[int], claim: int) -> None:
        """These free pages, private to `claim`: a persisted L3 index's slots adopted at start
        (hicache/l3_index.py). The free runs are rebuilt from the owner table: a walk over the tier,
        once. A page not free (or twice, or out of range) raises, taking nothing."""
        if claim not in self.claim_labels:
            raise AllocatorError(f"{self.name}: unknown claim {claim}")
        idx = np.asarray(sorted(map(int, pages)), dtype=np.int64)
        if not len(idx):
            return
        if idx[0] < 0 or idx[-1] >= self.num_pages or len(np.unique(idx)) != len(idx):
            raise AllocatorError(f"{self.name}: take: pages out of range or listed twice")
        busy = idx[self.owner[idx] != FREE]
        if len(busy):
            raise AllocatorError(f"{self.name}: take: pages {busy[:8].tolist()} are not free")
        self.owner[idx] = claim
        self._held[claim].update(idx.tolist())
        self.num_free -= len(idx)
        self._runs, self._run_at, self._run_ending = [], {}, {}
        free = np.flatnonzero(self.owner == FREE)
        for run in np.split(free, np.flatnonzero(np.diff(free) != 1) + 1):
            if len(run):
                self._add_run(int(run[0]), len(run))

    def free(self, pages: Sequence[int], claim: int) -> None:
        """Return private pages of `claim` to the free set."""
        self._move(pages, expect=claim, to=FREE)
        self.num_free += len(pages)

    def give_to_tree(self, pages: Sequence[int], claim: int) -> None:
        """Publish private pages: the tree owns them from now on."""
        self._move(pages, expect=claim, to=TREE)

    def free_from_tree(self, pages: Sequence[int]) -> None:
        """Eviction: tree pages go back to the free set."""
        self._move(pages, expect=TREE, to=FREE)
        self.num_free += len(pages)

    def _move(self, pages: Sequence[int], expect: int, to: int) -> None:
        if len(pages) == 0:
            return
        listed = sorted(map(int, pages))
        lo, hi = listed[0], listed[-1] + 1
        if lo < 0 or hi > self.num_pages:
            raise AllocatorError(f"{self.name}: page index out of range")
        run = hi - lo == len(listed) and listed == list(range(lo, hi))  # one consecutive run: a slice
        if run and self.owner[lo:hi].tolist().count(expect) == hi - lo:
            idx = slice(lo, hi)
        else:  # scattered pages, or a wrong owner to report
            if len(set(listed)) != len(listed):
                raise AllocatorError(f"{self.name}: duplicate pages in one call")
            idx = np.fromiter(listed, dtype=np.int64, count=len(listed))
            wrong = idx[self.owner[idx] != expect]
            if len(wrong):
                raise AllocatorError(
                    f"{self.name}: pages {wrong[:8].tolist()} owned by {self.owner[wrong[:8]].tolist()}, "
                    f"expected {expect}")
        self.owner[idx] = to
        if expect >= 0:
            self._held[expect].difference_update(listed)
        if to == FREE:
            if run:
                self._release_run(lo, hi)
            else:
                self._release_runs(listed)

    # -- inspection ---------------------------------------------------------------------------
    def pages_of(self, claim: int) -> list[int]:
        return sorted(self._held.get(claim, ()))

    def num_private(self) -> int:
        return sum(len(pages) for pages in self._held.values())

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
        # the indexes agree with the owner table: free runs are exactly the maximal FREE runs, and
        # each claim's set is exactly its pages
        free = np.flatnonzero(self.owner == FREE)
        breaks = np.flatnonzero(np.diff(free) != 1) + 1
        want = sorted((len(r), int(r[0])) for r in np.split(free, breaks) if len(r))
        # (all three indexes: freeing merges neighbours through _run_ending and _run_at, so a stale
        # entry there would merge across pages the tree owns; the referee used to miss it)
        if (want != self._runs or self._run_at != {start: length for length, start in want}
                or self._run_ending != {start + length: start for length, start in want}):
            raise AssertionError(f"{self.name}: free-run index disagrees with the owner table")
        for claim, pages in self._held.items():
            if sorted(pages) != np.flatnonzero(self.owner == claim).tolist():
                raise AssertionError(f"{self.name}: claim {self.claim_labels.get(claim)} index disagrees")

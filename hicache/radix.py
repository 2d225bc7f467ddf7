"""One radix tree, three residencies.

A node is a run of whole pages of tokens. Per tier (L1 device, L2 host, L3 storage) it carries its page
indices in that tier or None, a lock count and an LRU stamp. Rules (checked by `check_integrity`):
  - residency is page aligned and, within a tier, contiguous from the root (a resident node's parent
    is resident in that tier too);
  - a locked node (lock count > 0 in a tier) cannot lose that tier: locks protect transfer sources and
    the prefixes that running requests read;
  - each tier evicts its own LRU leaves (resident, unlocked, no resident child in that tier) and clears
    only its own residency; a node leaves the tree when no tier holds it and it has no children;
  - splitting a node splits every tier's pages and copies lock counts to the new upper half.
Pages move between the tree and the tier allocators only here: `insert` publishes private pages,
eviction (reported through `on_evict`) and `drop` (corrupt or vanished L3 pages; reported through
`on_drop`) free tree pages.
"""
from __future__ import annotations

import enum
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hicache.allocator import PageAllocator


class Tier(enum.IntEnum):
    L1 = 0
    L2 = 1
    L3 = 2

    @property
    def label(self) -> str:
        return self.name.lower()


TIERS = (Tier.L1, Tier.L2, Tier.L3)


class Node:
    __slots__ = ("key", "children", "parent", "pages", "locks", "stamp", "node_id", "hits", "resident_children")
    _ids = itertools.count()

    def __init__(self, key: tuple[int, ...], parent: "Node | None") -> None:
        self.key = key
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.pages: list[list[int] | None] = [None, None, None]  # per tier: page indices or None
        self.locks = [0, 0, 0]
        self.stamp = [0, 0, 0]
        self.hits = 0  # times a request matched through this node (write_through_selective)
        # per tier, how many children are resident there: whether the node is a tier's leaf without a walk over
        # its children (regression: evicting the branches of one prefix from L1 that L2 still held walked every
        # sibling evicted before each one, quadratic in the branches)
        self.resident_children = [0, 0, 0]
        self.node_id = next(Node._ids)

    def on_or_below(self, nodes: "set[Node] | frozenset[Node]") -> bool:
        """Whether this node is one of `nodes` or lies below one of them (its K/V was computed on
        top of theirs)."""
        node: Node | None = self
        while node is not None:
            if node in nodes:
                return True
            node = node.parent
        return False

    def __repr__(self) -> str:
        return f"Node({self.node_id}, len={len(self.key)}, tiers={[p is not None for p in self.pages]})"


@dataclass
class MatchResult:
    """Per tier: matched length in tokens (page aligned, contiguous from the root), the deepest
    resident node (the handle to lock), and the page indices covering that length."""
    lengths: list[int] = field(default_factory=lambda: [0, 0, 0])
    handles: list[Node | None] = field(default_factory=lambda: [None, None, None])
    pages: list[list[int]] = field(default_factory=lambda: [[], [], []])
    path: list[Node] = field(default_factory=list)
    path_tokens: int = 0  # tokens along `path` (any residency)

    def length(self, tier: Tier) -> int:
        return self.lengths[tier]


class RadixTree:
    def __init__(self, page_size: int, allocators: dict[Tier, PageAllocator]) -> None:
        self.page_size = page_size
        self.allocators = allocators
        self.root = Node((), None)
        self.root.locks = [1, 1, 1]  # the root is never evicted
        self._tick = 0
        # per tier, bumped whenever what a walk finds of it may change (the tier gains or loses a node's pages; a
        # split, all): a caller may keep a walk's result until then (scheduler/reservations.py, the queue's head
        # checked at every decode step; admission.py, the queue's order under "lpm" at every prefill pass)
        self.changes = [0, 0, 0]
        self.num_resident_pages = [0, 0, 0]
        # per tier, pages of nodes with a lock in that tier (a locked node is resident): what
        # eviction may not take, kept as locks go 0 -> 1 -> 0, so that asking how much could be
        # evicted (every admission does) costs nothing instead of a walk over the whole tree
        self.num_locked_pages = [0, 0, 0]
        # per tier, a min-heap of eviction candidates (stamp, node id, node), kept as nodes become
        # leaves of that tier (see _offer) instead of collected by a walk over the whole tree on
        # every eviction; entries go stale (evicted, locked, touched since) and are checked when popped
        self._candidates: list[list[tuple[int, int, Node]]] = [[], [], []]
        self.on_evict: Callable[[Tier, Node, list[int]], None] | None = None
        self.on_drop: Callable[[Tier, list[int]], None] | None = None

    # -- matching -----------------------------------------------------------------------------
    def _now(self) -> int:
        self._tick += 1
        return self._tick

    @property
    def tick(self) -> int:
        """The latest LRU stamp handed out: a node touched after this moment has a larger one."""
        return self._tick

    def _page_key(self, tokens: Sequence[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos: pos + self.page_size])

    def match(self, tokens: Sequence[int], *, include_storage: bool = True, touch: bool = True,
              split: bool = True) -> MatchResult:
        """Walk once; return per tier the matched page-aligned length, handle and pages."""
        tokens = tuple(tokens)
        limit = len(tokens) - len(tokens) % self.page_size
        result = MatchResult()
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            common = self._common_len(child.key, tokens, pos, limit)
            if common < len(child.key):
                if not split:
                    break
                child = self._split(child, common)
            result.path.append(child)
            pos += len(child.key)
            node = child
        result.path_tokens = pos
        stamp = self._now() if touch else 0
        tiers = TIERS if include_storage else TIERS[:2]
        for tier in tiers:
            length = 0
            for n in result.path:
                if n.pages[tier] is None:
                    break
                result.pages[tier].extend(n.pages[tier])
                result.handles[tier] = n
                length += len(n.key)
                if touch:
                    n.stamp[tier] = stamp
            result.lengths[tier] = length
        return result

    def resident_tokens(self, tokens: Sequence[int], tier: Tier, end: int | None = None) -> int:
        """How many of tokens[:end] (page aligned) `tier` holds from the root, read only: no split, stamp or lock,
        and no copy of the tokens past what matches (a queue's order under scheduling_policy "lpm")."""
        ps = self.page_size
        limit = len(tokens) if end is None else min(end, len(tokens))
        limit -= limit % ps
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None or child.pages[tier] is None:
                break
            n = min(len(child.key), limit - pos)
            common = self._common_len(child.key, tuple(tokens[pos:pos + n]), 0, n)  # (a copy of what is compared)
            pos += common
            if common < len(child.key):
                break
            node = child
        return pos

    def _common_len(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int, limit: int) -> int:
        n = min(len(key), limit - pos)
        if tokens[pos: pos + n] == key[:n]:
            return n - n % self.page_size
        common = self.page_size  # the first page matched through the children dict
        while common + self.page_size <= n and \
                key[common: common + self.page_size] == tokens[pos + common: pos + common + self.page_size]:
            common += self.page_size
        return common

    def _split(self, node: Node, at_tokens: int) -> Node:
        """Split `node` so its first `at_tokens` tokens become a new parent; returns that parent."""
        at_pages = at_tokens // self.page_size
        self.changes = [c + 1 for c in self.changes]
        upper = Node(node.key[:at_tokens], node.parent)
        upper.locks = list(node.locks)
        upper.stamp = list(node.stamp)
        upper.hits = node.hits
        for tier in TIERS:
            pages = node.pages[tier]
            if pages is not None:
                upper.pages[tier] = pages[:at_pages]
                node.pages[tier] = pages[at_pages:]
                upper.resident_children[tier] = 1  # `node`, its only child (the parent's count is unchanged)
        parent = node.parent
        assert parent is not None
        parent.children[upper.key[:self.page_size]] = upper
        node.key = node.key[at_tokens:]
        node.parent = upper
        upper.children[node.key[:self.page_size]] = node
        return upper

    # -- insertion / publication -------------------------------------------------------------
    def insert(self, tokens: Sequence[int], tier: Tier, pages: Sequence[int], claim: int,
               start_tokens: int = 0, stamp_from: Tier | None = None) -> list[int]:
        """Publish `pages` (private to `claim`) as tier residency of tokens[start_tokens:].

        tokens[:start_tokens] must already be resident in `tier` (contiguity). Pages for tokens
        that the tier already holds are not taken: they are returned, still private, for the caller
        to free. Returns those duplicate pages.

        stamp_from: a copy down from that tier (a backup), which is no use of the prefix: its nodes
        keep their last use there as their LRU stamp in `tier`, instead of now (regression: under
        write_back a prefix is backed up as it leaves L1, the coldest, and became L2's most recent).
        """
        tokens = tuple(tokens)
        num_tokens = len(tokens)
        if num_tokens % self.page_size or start_tokens % self.page_size:
            raise ValueError("insert: lengths must be page aligned")
        if len(pages) != (num_tokens - start_tokens) // self.page_size:
            raise ValueError(f"insert: {len(pages)} pages for {num_tokens - start_tokens} tokens")
        alloc = self.allocators[tier]
        duplicates: list[int] = []
        node, pos = self.root, 0
        stamp = self._now()
        while pos < num_tokens:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                child = Node(tokens[pos:], node)
                node.children[child.key[:self.page_size]] = child
            else:
                common = self._common_len(child.key, tokens, pos, num_tokens)
                if common < len(child.key):
                    child = self._split(child, common)
            end = pos + len(child.key)
            use = stamp if stamp_from is None or child.pages[stamp_from] is None else child.stamp[stamp_from]
            if end > start_tokens:
                lo = max(pos, start_tokens)
                mine = list(pages[(lo - start_tokens) // self.page_size: (end - start_tokens) // self.page_size])
                if child.pages[tier] is None:
                    if lo > pos or (node is not self.root and node.pages[tier] is None):
                        self._maybe_remove(child)  # leave no empty node behind
                        raise ValueError(f"insert: tokens before token {lo} are not resident in "
                                         f"{tier.name} (residency must be contiguous from the root)")
                    alloc.give_to_tree(mine, claim)  # per node, so a later error leaves no half state
                    child.pages[tier] = mine
                    self.changes[tier] += 1
                    node.resident_children[tier] += 1
                    self.num_resident_pages[tier] += len(mine)
                    child.stamp[tier] = use
                    self._offer(child, tier)
                else:
                    duplicates.extend(mine)
            elif child.pages[tier] is None:
                self._maybe_remove(child)
                raise ValueError(f"insert: tokens before token {start_tokens} are not resident in {tier.name}")
            child.stamp[tier] = use if stamp_from is None else max(child.stamp[tier], use)  # (never older)
            node, pos = child, end
        return duplicates

    # -- locks --------------------------------------------------------------------------------
    def lock(self, node: Node | None, tier: Tier) -> None:
        while node is not None and node is not self.root:
            if node.pages[tier] is None:
                raise ValueError(f"lock: node not resident in {tier.name}")
            if node.locks[tier] == 0:
                self.num_locked_pages[tier] += len(node.pages[tier])
            node.locks[tier] += 1
            node = node.parent

    def unlock(self, node: Node | None, tier: Tier) -> None:
        while node is not None and node is not self.root:
            if node.locks[tier] <= 0:
                raise ValueError(f"unlock: lock count of {node} in {tier.name} would go negative")
            node.locks[tier] -= 1
            if node.locks[tier] == 0:
                self.num_locked_pages[tier] -= len(node.pages[tier])
                self._offer(node, tier)
            node = node.parent

    # -- eviction -----------------------------------------------------------------------------
    def _is_tier_leaf(self, node: Node, tier: Tier) -> bool:
        return (node is not self.root and node.pages[tier] is not None and node.locks[tier] == 0
                and not node.resident_children[tier])

    def iter_nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evictable_pages(self, tier: Tier) -> int:
        """Pages that eviction could free in this tier (resident and not locked)."""
        return self.num_resident_pages[tier] - self.num_locked_pages[tier]

    def _offer(self, node: Node | None, tier: Tier) -> None:
        """`node` may have just become an eviction candidate of `tier` (resident, unlocked, no
        resident child): it became resident, its last lock went, or its last resident child left.
        Every candidate has an entry no later than its stamp; touches are caught up when popped."""
        if node is not None and node is not self.root and node.pages[tier] is not None and not node.locks[tier]:
            heapq.heappush(self._candidates[tier], (node.stamp[tier], node.node_id, node))
            self._bound_candidates(tier)

    def _bound_candidates(self, tier: Tier) -> None:
        """Mostly stale entries: start afresh (a walk, once entries exceed twice the resident pages
        + 64). Checked when an entry comes in and when pages leave the tier by a drop (regression:
        failed L3 reads dropped most of L3 with no offer after them, and an idle tree kept 110
        entries for 19 resident pages)."""
        if len(self._candidates[tier]) > 2 * self.num_resident_pages[tier] + 64:
            self._rebuild_candidates(tier)

    def restamp(self, tier: Tier, nodes: Sequence[Node]) -> None:
        """Stamps in `tier` for `nodes` in that order (the least recently used first), each later than
        any handed out so far: the LRU order of an adopted L3 index (hicache/l3_index.py)."""
        for node in nodes:
            node.stamp[tier] = self._now()
        self._rebuild_candidates(tier)

    def _rebuild_candidates(self, tier: Tier) -> None:
        heap = self._candidates[tier]  # in place: an eviction in progress holds this list
        heap[:] = [(n.stamp[tier], n.node_id, n) for n in self.iter_nodes() if self._is_tier_leaf(n, tier)]
        heapq.heapify(heap)

    def evict(self, tier: Tier, num_pages: int,
              keep: Callable[[Node], bool] | None = None) -> int:
        """Free at least `num_pages` pages of `tier` from LRU leaves of that tier (fewer if not
        enough are evictable). `keep(node)` may veto a leaf (e.g. write_back wants it backed up
        first). Returns the number of pages freed."""
        heap = self._candidates[tier]
        freed, vetoed = 0, []
        try:  # (a veto or an on_evict that raises leaves the tree whole: every leaf found again, none empty)
            while freed < num_pages and heap:
                stamp, _, node = heapq.heappop(heap)
                if node.parent is None or not self._is_tier_leaf(node, tier):
                    continue  # gone, locked or no longer a leaf: offered again if it becomes one
                if stamp != node.stamp[tier]:  # touched since it was offered: back in at its stamp
                    heapq.heappush(heap, (node.stamp[tier], node.node_id, node))
                    continue
                if keep is not None:
                    vetoed.append(node)  # (until keep said no: offered again below, also if it raises)
                    if keep(node):
                        continue
                    vetoed.pop()
                pages = node.pages[tier]
                assert pages is not None
                node.pages[tier] = None
                self.changes[tier] += 1
                node.parent.resident_children[tier] -= 1
                self.num_resident_pages[tier] -= len(pages)
                self.allocators[tier].free_from_tree(pages)
                freed += len(pages)
                parent = node.parent
                self._maybe_remove(node)
                if parent is not None and self._is_tier_leaf(parent, tier):
                    self._offer(parent, tier)
                if self.on_evict is not None:
                    self.on_evict(tier, node, pages)
        finally:
            for node in vetoed:
                self._offer(node, tier)
        return freed

    def drop(self, node: Node, tier: Tier, from_pages: int = 0) -> list[int]:
        """Remove `node` and its whole subtree from `tier` (e.g. a corrupt or vanished L3 page).
        from_pages: keep the node's first pages, valid ones before a bad page (the node is split
        there and only its lower half goes). Returns the freed pages. Locked nodes raise."""
        if 0 < from_pages * self.page_size < len(node.key):
            if node.locks[tier]:  # (before splitting: a refused drop leaves the tree as it was)
                raise ValueError(f"drop: {node} is locked in {tier.name}")
            self._split(node, from_pages * self.page_size)  # `node` stays the lower half
        freed: list[int] = []
        stack = [node]
        order: list[Node] = []
        above = node.parent  # may become a leaf of the tier
        while stack:
            n = stack.pop()
            if n.pages[tier] is None:
                continue
            if n.locks[tier]:
                raise ValueError(f"drop: {n} is locked in {tier.name}")
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # leaves first
            pages = n.pages[tier]
            n.pages[tier] = None
            self.changes[tier] += 1
            n.parent.resident_children[tier] -= 1
            self.num_resident_pages[tier] -= len(pages)
            self.allocators[tier].free_from_tree(pages)
            freed.extend(pages)
        for n in reversed(order):
            if n.parent is not None:  # removing a leaf may already have removed its emptied parent
                self._maybe_remove(n)
        if above is not None and above.parent is not None and self._is_tier_leaf(above, tier):
            self._offer(above, tier)
        self._bound_candidates(tier)
        if freed and self.on_drop is not None:
            self.on_drop(tier, freed)
        return freed

    def _maybe_remove(self, node: Node) -> None:
        while (node is not self.root and not node.children
               and all(p is None for p in node.pages) and not any(node.locks)):
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[:self.page_size]]
            node.parent = None
            node = parent

    # -- integrity ----------------------------------------------------------------------------
    def tree_pages(self, tier: Tier) -> list[int]:
        out: list[int] = []
        for n in self.iter_nodes():
            if n.pages[tier] is not None:
                out.extend(n.pages[tier])
        return out

    def check_lock_holders(self, holds: Counter) -> None:
        """The locks on the tree are those its holders hold: `holds` counts, per (node, tier), the holders that
        locked that node (a lock counts on every ancestor: a node's own locks are its count less its children's).
        A lock no holder holds (a release skipped) kept its pages from eviction for good; a node locked fewer times
        than its children (a count gone wrong) fails too (its own count negative)."""
        own = Counter({(n, tier): n.locks[tier] - sum(c.locks[tier] for c in n.children.values())
                       for n in self.iter_nodes() if n is not self.root for tier in TIERS})
        if own != holds:  # (Counters: a missing key counts 0; a negative own count is unequal to any hold)
            below = {key: k for key, k in own.items() if k < 0}
            raise AssertionError(f"locks held by no holder: {dict(own - holds)}; held but not locked: "
                                 f"{dict(holds - own)}; counts below their children's: {below}")

    def check_integrity(self) -> None:
        """Invariants 1, 3, 4 of DESIGN.md section 4 for the tree and every tier allocator."""
        counts, locked = [0, 0, 0], [0, 0, 0]
        for n in self.iter_nodes():
            if n is self.root:
                continue
            if n.parent is None or n.parent.children.get(n.key[:self.page_size]) is not n:
                raise AssertionError(f"{n}: parent pointer / child key disagree")
            if not n.key or len(n.key) % self.page_size:
                raise AssertionError(f"{n}: key length {len(n.key)} not page aligned")
            if not n.children and all(p is None for p in n.pages) and not any(n.locks):
                raise AssertionError(f"{n}: empty leaf left in the tree")
            for tier in TIERS:
                pages = n.pages[tier]
                if n.locks[tier] < 0:
                    raise AssertionError(f"{n}: negative lock count")
                child_locks = sum(c.locks[tier] for c in n.children.values())
                if n.locks[tier] < child_locks:
                    raise AssertionError(f"{n}: lock count {n.locks[tier]} < children's {child_locks}")
                if pages is None:
                    if n.locks[tier]:
                        raise AssertionError(f"{n}: locked in {tier.name} but not resident")
                    continue
                if len(pages) * self.page_size != len(n.key):
                    raise AssertionError(f"{n}: {len(pages)} {tier.name} pages for {len(n.key)} tokens")
                if n.parent is not self.root and n.parent.pages[tier] is None:
                    raise AssertionError(f"{n}: resident in {tier.name} but its parent is not (hole)")
                counts[tier] += len(pages)
                locked[tier] += len(pages) if n.locks[tier] else 0
        for tier in TIERS:
            if counts[tier] != self.num_resident_pages[tier]:
                raise AssertionError(f"{tier.name}: resident count {self.num_resident_pages[tier]} "
                                     f"!= {counts[tier]} pages in nodes")
            if locked[tier] != self.num_locked_pages[tier]:
                raise AssertionError(f"{tier.name}: locked count {self.num_locked_pages[tier]} "
                                     f"!= {locked[tier]} pages in locked nodes")
            offered: dict[int, int] = {}  # node id -> its earliest candidate entry
            for stamp, node_id, _ in self._candidates[tier]:
                offered[node_id] = min(stamp, offered.get(node_id, stamp))
            for n in self.iter_nodes():
                if self._is_tier_leaf(n, tier) and offered.get(n.node_id, n.stamp[tier] + 1) > n.stamp[tier]:
                    raise AssertionError(f"{n}: a leaf of {tier.name} that eviction would not find")
            if tier in self.allocators:
                self.allocators[tier].check(self.tree_pages(tier))
            elif counts[tier]:
                raise AssertionError(f"{tier.name}: pages resident in a tier that does not exist")
        for n in self.iter_nodes():  # (what `_is_tier_leaf` reads)
            resident = [sum(c.pages[tier] is not None for c in n.children.values()) for tier in TIERS]
            if n.resident_children != resident:
                raise AssertionError(f"{n}: counts {n.resident_children} resident children per tier, not {resident}")

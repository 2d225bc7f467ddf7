"""What the radix tree holds after a context: the tokens that followed it in an earlier sequence.

The tree keeps every published sequence's tokens, prompt and answer alike, for as long as any tier holds their
pages (and an L1 eviction alone does not drop them while L2 or L3 still holds them). So when a request's whole
context so far (its cached prompt and its output) is a path in the tree that goes on, an earlier request with
the same context went on that way: at temperature 0 the same model gives the same answer, and the path's next
tokens are drafts a verify step is likely to accept (scheduler/speculative.py, `cache_lookup`). A salted
request's context starts with its salted first token (scheduler/request.py salted_prompt), so it only meets
sequences of its own salt, as its prefix hits do.

The walk reads tokens only: no page, lock, LRU stamp or hit count changes, and no node is split. Where the
context ends inside a page, or at a node with several children, the most recently used branch that fits is taken.
A walk returns an anchor (the deepest node the context covered whole, and its end in tokens) from which the next
walk of the same growing context starts, so a step costs the tokens since the last one, not the whole context.

The tree holds whole pages only, and an answer's last tokens (its partial last page, and the last token, whose
K/V was never computed) would be lost to drafting: a 64-token answer lost up to a quarter of its steps. `Tails`
keeps them, per node a finished sequence ended on, for walks that reach that node's end or the tail itself.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from hicache.radix import Node, RadixTree


def _latest(nodes: Iterable[Node]) -> Node | None:
    """The most recently used of `nodes` in any tier (the tree's stamps come from one clock)."""
    return max(nodes, key=lambda n: max(n.stamp), default=None)


def attached(tree: RadixTree, node: Node) -> bool:
    """Whether `node` is still in the tree (a removed node loses its parent; a split keeps the lower half's
    identity and end, so an anchor survives splits)."""
    return node is tree.root or node.parent is not None


class Tails:
    """The tokens a finished sequence had past the last node it published (fewer than a page and its last token),
    per node (the latest sequence's), for the `capacity` nodes most recently given one, keyed by the node's id
    alone (ids are never reused): an entry whose node left the tree is never read, and keeps no node alive
    (regression, session 58's hunt: each entry held its node, and so the whole key of one the tree had dropped, as
    long as its prompt: up to `capacity` dead prompts in host memory on a long-running server)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._tails: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # node_id -> tokens

    def put(self, node: Node, tokens: Sequence[int]) -> None:
        self._tails[node.node_id] = tuple(tokens)
        self._tails.move_to_end(node.node_id)
        while len(self._tails) > self.capacity:
            self._tails.popitem(last=False)

    def get(self, tree: RadixTree, node: Node) -> tuple[int, ...]:
        return self._tails.get(node.node_id, ()) if attached(tree, node) else ()

    def __len__(self) -> int:
        return len(self._tails)


class Joined:
    """Two token lists read as one (a request's prompt, then its output), sliced without copying either whole: a
    walk reads a page or a node's run at a time from its anchor on."""

    __slots__ = ("head", "rest")

    def __init__(self, head: Sequence[int], rest: Sequence[int]) -> None:
        self.head, self.rest = head, rest

    def __len__(self) -> int:
        return len(self.head) + len(self.rest)

    def __getitem__(self, part: slice) -> list[int]:
        start, stop, _ = part.indices(len(self))  # (slices of step 1 only)
        cut = len(self.head)
        if stop <= cut:
            return list(self.head[start:stop])
        if start >= cut:
            return list(self.rest[start - cut:stop - cut])
        return list(self.head[start:]) + list(self.rest[:stop - cut])


def continuation(tree: RadixTree, tokens: Sequence[int], max_tokens: int, node: Node | None = None,
                 tails: Tails | None = None, start: int = 0) -> tuple[list[int], Node, int]:
    """tokens[start:]: a context's tokens after `node`'s path (the root's by default). -> (up to max_tokens tokens
    that followed them in the tree, then in `tails`, [] when the path ends or strays; the deepest node they cover
    whole; the position in tokens where it ends)."""
    ps = tree.page_size
    node = tree.root if node is None else node
    anchor, anchor_pos = node, start
    pos, n = start, len(tokens)
    while pos < n:
        rest = n - pos
        if rest >= ps:
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            checked = ps
        else:  # the context ends inside a page: any child whose first page starts with it
            part = tuple(tokens[pos:])
            child = _latest(c for c in node.children.values() if c.key[:rest] == part)
            checked = rest
        if child is None:  # (past the pages: a tail that starts with the rest)
            tail = tails.get(tree, node) if tails is not None else ()
            ok = len(tail) > rest and tuple(tokens[pos:]) == tail[:rest]
            return list(tail[rest:rest + max_tokens]) if ok else [], anchor, anchor_pos
        covered = min(len(child.key), rest)
        if covered > checked and tuple(tokens[pos + checked:pos + covered]) != child.key[checked:covered]:
            return [], anchor, anchor_pos
        if covered < len(child.key):  # the context ends inside this node: what follows in it, then below
            return _down(tree, child, covered, max_tokens, tails), anchor, anchor_pos
        node, pos = child, pos + covered
        anchor, anchor_pos = node, pos
    return _down(tree, node, len(node.key), max_tokens, tails), anchor, anchor_pos


def _down(tree: RadixTree, node: Node, offset: int, max_tokens: int, tails: Tails | None) -> list[int]:
    """Up to max_tokens tokens of `node`'s key from `offset`, then of its most recently used descendants, then of
    the tail of the leaf reached."""
    out = list(node.key[offset:offset + max_tokens])
    while len(out) < max_tokens and (child := _latest(node.children.values())) is not None:
        out.extend(child.key[:max_tokens - len(out)])
        node = child
    if len(out) < max_tokens and not node.children and tails is not None:
        out.extend(tails.get(tree, node)[:max_tokens - len(out)])
    return out

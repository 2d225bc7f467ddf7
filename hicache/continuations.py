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
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from hicache.radix import Node, RadixTree


def _latest(nodes: Iterable[Node]) -> Node | None:
    """The most recently used of `nodes` in any tier (the tree's stamps come from one clock)."""
    return max(nodes, key=lambda n: max(n.stamp), default=None)


def attached(tree: RadixTree, node: Node) -> bool:
    """Whether `node` is still in the tree (a removed node loses its parent; a split keeps the lower half's
    identity and end, so an anchor survives splits)."""
    return node is tree.root or node.parent is not None


def continuation(tree: RadixTree, tokens: Sequence[int], max_tokens: int,
                 node: Node | None = None) -> tuple[list[int], Node, int]:
    """tokens: a context's tokens after `node`'s path (the root's by default). -> (up to max_tokens tokens that
    followed them in the tree, [] when the path ends or strays; the deepest node the tokens cover whole; how many
    of the tokens reach its end)."""
    ps = tree.page_size
    node = tree.root if node is None else node
    anchor, anchor_pos = node, 0
    pos, n = 0, len(tokens)
    while pos < n:
        rest = n - pos
        if rest >= ps:
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            checked = ps
        else:  # the context ends inside a page: any child whose first page starts with it
            part = tuple(tokens[pos:])
            child = _latest(c for c in node.children.values() if c.key[:rest] == part)
            checked = rest
        if child is None:
            return [], anchor, anchor_pos
        covered = min(len(child.key), rest)
        if covered > checked and tuple(tokens[pos + checked:pos + covered]) != child.key[checked:covered]:
            return [], anchor, anchor_pos
        if covered < len(child.key):  # the context ends inside this node: what follows in it, then below
            return _down(child, covered, max_tokens), anchor, anchor_pos
        node, pos = child, pos + covered
        anchor, anchor_pos = node, pos
    return _down(node, len(node.key), max_tokens), anchor, anchor_pos


def _down(node: Node, offset: int, max_tokens: int) -> list[int]:
    """Up to max_tokens tokens of `node`'s key from `offset`, then of its most recently used descendants."""
    out = list(node.key[offset:offset + max_tokens])
    while len(out) < max_tokens and (node := _latest(node.children.values())) is not None:
        out.extend(node.key[:max_tokens - len(out)])
    return out

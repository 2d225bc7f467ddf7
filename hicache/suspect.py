"""Dropping a cached prefix whose K/V is suspect (a request that reused it got NaN logits:
scheduler/admission.py `_fail_nan`). Kept out of the manager (hicache/manager.py), which it only uses."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hicache.radix import Tier

if TYPE_CHECKING:
    from hicache.manager import CacheManager


def drop_suspect_prefix(mgr: "CacheManager", tokens: Sequence[int]) -> tuple[dict[str, int], int]:
    """Every tier's copy of the cached prefix `tokens` (page aligned) leaves the tree with everything
    below it (computed on top of it), except what is locked in a tier: a running request reads it, an
    operation copies it. Per tier, the shallowest node of the prefix unlocked there goes with its
    subtree (RadixTree.drop: the tier allocators get the pages back, L3 slots are invalidated); the
    locked nodes above it stay, and a request that fails on them later drops them then. Dropped L1
    pages are zeroed (the pool holds finite values: the unwritten tail of a page a request is given
    is read and masked, and NaN * 0 is NaN; on the device the zeroing is enqueued after every step
    that read them). Returns (pages dropped per tier label, tokens of the prefix some tier still
    matches)."""
    tree = mgr.tree
    m = tree.match(tokens, include_storage=True, touch=False)
    dropped: dict[str, int] = {}
    for tier in tree.allocators:
        for node in m.path:
            if node.pages[tier] is None:
                break
            if not node.locks[tier]:  # (nor its subtree's: a lock counts on every ancestor)
                pages = tree.drop(node, tier)
                dropped[tier.label] = len(pages)
                if tier is Tier.L1 and pages and not mgr.simulate:
                    kv = mgr.l1.kv
                    kv[:, :, torch.tensor(pages, dtype=torch.int64, device=kv.device)] = 0
                break
    for label, num_pages in dropped.items():
        mgr.metrics.nan_dropped_pages[label] += num_pages
    kept = tree.match(tokens, include_storage=True, touch=False, split=False)
    return dropped, max(kept.lengths)

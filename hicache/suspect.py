"""Dropping a cached prefix whose K/V is suspect (a request that reused it got NaN logits:
scheduler/admission.py `_fail_nan`). Kept out of the manager (hicache/manager.py), which it only uses."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

from hicache.radix import Tier

if TYPE_CHECKING:
    from hicache.manager import CacheManager


def drop_suspect_prefix(mgr: "CacheManager", tokens: Sequence[int],
                        tiers: Collection[Tier] | None = None) -> tuple[dict[str, int], int]:
    """Every tier's copy of the cached prefix `tokens` (page aligned) leaves the tree with everything
    below it (computed on top of it), except what is locked in a tier: a running request reads it, an
    operation copies it. Per tier, the shallowest node of the prefix unlocked there goes with its
    subtree (RadixTree.drop: the tier allocators get the pages back, L3 slots are invalidated); the
    locked nodes above it stay, and a request that fails on them later drops them then; a backup,
    restore or prefetch locking them publishes nothing more and, as its last locks go, they are
    dropped again in the tiers it held (`tiers`: only those; OpRunner.stop_backups_of, also for a
    backup a drain had cancelled already, stop_restores_of: the request waiting for a restore
    recomputes). Dropped L1 pages are zeroed (the pool holds finite values: the unwritten tail of a
    page a request is given is read and masked, and NaN * 0 is NaN; on the device the zeroing is
    enqueued after every step that read them). A shared L3 (Redis) also loses the keys of the
    prefix's pages from the first one L3 no longer holds here to the prefix's end (`_delete_shared`).
    Returns (pages dropped per tier label, tokens of the prefix some tier still matches)."""
    tree = mgr.tree
    m = tree.match(tokens, include_storage=True, touch=False)
    dropped: dict[str, int] = {}
    for tier in tree.allocators if tiers is None else sorted(tiers):
        for node in m.path:
            if node.pages[tier] is None:
                break
            if not node.locks[tier]:  # (nor its subtree's: a lock counts on every ancestor)
                pages = tree.drop(node, tier)
                dropped[tier.label] = len(pages)
                if tier is Tier.L1:
                    zero_l1_pages(mgr, pages)
                break
    for label, num_pages in dropped.items():
        mgr.metrics.nan_dropped_pages[label] += num_pages
    # (regression: a backup copying the prefix kept its source locked, then published its L2 and L3
    # copy of the corrupt pages, and the next request for the prompt failed on them again)
    again = lambda held: drop_suspect_prefix(mgr, tokens, held)  # noqa: E731
    mgr.runner.stop_backups_of(m.path, again)
    # (regression: a restore or prefetch copying the pages below it published its copy, and the
    # request waiting for it, or the next, ran on the corrupt K/V and failed too)
    mgr.runner.stop_restores_of(m.path, again)
    kept = tree.match(tokens, include_storage=True, touch=False, split=False)
    _delete_shared(mgr, tokens, kept.lengths[Tier.L3])
    return dropped, max(kept.lengths)


def zero_l1_pages(mgr: "CacheManager", pages: Sequence[int]) -> None:
    """Zero L1 pages leaving a suspect prefix for the free pool (drop_suspect_prefix's reason)."""
    if pages and not mgr.simulate:
        kv = mgr.l1.kv
        kv[:, :, torch.tensor(list(pages), dtype=torch.int64, device=kv.device)] = 0


def _delete_shared(mgr: "CacheManager", tokens: Sequence[int], kept_tokens: int) -> None:
    """Delete from a shared store the keys of tokens[kept_tokens:] (page aligned), kept_tokens being
    what L3 still holds here (a head an operation locks). Regression: the pages stayed in Redis,
    valid but NaN, so each later hint refresh found them and every request with that prefix, on
    every instance, failed. Pages the tree never hinted count too (another instance wrote them:
    the next refresh would find them). A file L3 is this process's own: the drop freed its slots."""
    delete = getattr(mgr.store, "delete_suspect", None)
    end_tokens = len(tokens) - len(tokens) % mgr.tree.page_size
    if delete is not None and kept_tokens < end_tokens:
        delete(mgr.store.page_keys(tokens, kept_tokens, end_tokens))

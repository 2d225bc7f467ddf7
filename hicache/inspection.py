"""Read-only views of a CacheManager (hicache/manager.py, which delegates its `tier_status`,
`status` and part of `check_integrity` here): what each tier holds, as operators see it (the
engine's status: /hicache/status, the Prometheus collectors, the replay's pool line), and whether
a local L3 store agrees with the tree, as tests and benchmarks check between phases. Nothing here
changes a page, a residency or a counter."""
from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.allocator import FREE
from hicache.radix import RadixTree, Tier

if TYPE_CHECKING:
    from hicache.manager import CacheManager


def tier_status(mgr: "CacheManager", tier: Tier) -> dict | None:
    """One tier's pages by state (None for a tier this manager has not)."""
    if tier not in mgr.tree.allocators:
        return None
    alloc = mgr.allocator(tier)
    evictable = mgr.tree.evictable_pages(tier)
    resident = mgr.tree.num_resident_pages[tier]
    return {"capacity_pages": alloc.num_pages, "free_pages": alloc.num_free,
            "resident_pages": resident, "evictable_pages": evictable,
            "protected_pages": resident - evictable, "private_pages": alloc.num_private(),
            "capacity_bytes": alloc.num_pages * mgr.geometry.bytes_per_page}


def manager_status(mgr: "CacheManager") -> dict:
    return {
        "enabled": mgr.config.enable,
        "geometry": mgr.geometry.describe(),
        "tiers": {t.label: mgr.tier_status(t) for t in (Tier.L1, Tier.L2, Tier.L3)},
        "pending": mgr.runner.pending_counts(),
        "transfer_backends": None if mgr.backends is None else {
            "gather": mgr.backends.gather, "scatter": mgr.backends.scatter,
            "reason": mgr.backends.reason, "timings_us": mgr.backends.timings_us},
        "storage": None if mgr.store is None else mgr.store.stats(),
        "cost_model": mgr.cost.state(),
        # whether backups to a tier pay off (throttled while its pages are evicted unread: hicache/reuse.py)
        "write_reuse": {t.label: mgr.reuse[t].state() for t in (Tier.L2, Tier.L3)},
        "policy": mgr.config.policy, "write_policy": mgr.config.write_policy,
        "metrics": mgr.metrics.as_dict(),
    }


def check_store(store, tree: RadixTree) -> None:
    """A local L3 store and the tree agree: every L3 page of the tree is readable, and no free
    slot is (a freed slot left readable would pass a stale read's checks). Stores that hold
    pages beyond this instance's tree (redis) have no `exists` and are not checked."""
    if store is None or not hasattr(store, "exists"):
        return
    alloc = tree.allocators[Tier.L3]
    free = [int(s) for s in (alloc.owner == FREE).nonzero()[0]]
    stale = [s for s, ok in zip(free, store.exists(free)) if ok] if free else []
    if stale:
        raise AssertionError(f"L3: free slots still readable in the store: {stale[:8]}")
    held = [p for node in tree.iter_nodes() if node.pages[Tier.L3] is not None for p in node.pages[Tier.L3]]
    unreadable = [p for p, ok in zip(held, store.exists(held)) if not ok] if held else []
    if unreadable:
        raise AssertionError(f"L3: tree pages not readable in the store: {unreadable[:8]}")

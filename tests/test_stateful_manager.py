"""The CacheManager under random sequences of operations (hypothesis stateful test, no model), and the
regression tests of the op-driver bugs that such sequences exposed.

Every step ends with `check_integrity()`; at teardown everything drains and, with nothing locked by a
caller, no tier holds a private page. The machine is synchronous, so it drives its own event loop:
a "complete" step runs the loop a few iterations (ops are asyncio tasks, file I/O runs on threads).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import pytest
import structlog
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)
from structlog.testing import capture_logs

from hicache.config import HiCacheConfig
from hicache.faults import Fault, FaultInjector
from hicache.geometry import KVGeometry
from hicache.manager import CacheManager
from hicache.ops import OpState
from hicache.radix import Tier

TIER_LIST = (Tier.L1, Tier.L2, Tier.L3)


# -- helpers -------------------------------------------------------------------------------------
def make_manager(l1_pages: int = 16, host_pages: int = 32, storage_pages: int = 64, page_size: int = 4,
                 dtype: torch.dtype = torch.float32, faults: FaultInjector | None = None,
                 **config) -> CacheManager:
    """A CPU manager with exact page counts per tier (storage_pages=0: no L3)."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=page_size, dtype=dtype)
    gib = 1 << 30
    config.setdefault("policy", "always")
    config.setdefault("transfer_backend", "torch")
    cfg = HiCacheConfig(enable=True, host_size_gb=host_pages * geometry.bytes_per_page / gib,
                        storage_size_gb=(storage_pages * geometry.bytes_per_page / gib) if storage_pages else None,
                        storage_ratio=2.0 if storage_pages else 0.0, **config)
    mgr = CacheManager(geometry, l1_pages, "cpu", cfg, faults=faults)
    assert mgr.l2.num_pages == host_pages
    assert (mgr.allocator(Tier.L3).num_pages if mgr.has_l3 else 0) == storage_pages
    return mgr


def write_prefix(mgr: CacheManager, tokens, start: int = 0, seed: int = 0) -> list[int] | None:
    """Compute (random KV) tokens[start:] into fresh L1 pages and publish them, as a request would.
    Returns the L1 pages, or None when L1 has no room."""
    num_pages = (len(tokens) - start) // mgr.page_size
    claim = mgr.new_claim("writer")
    pages = mgr.alloc_l1(num_pages, claim)
    if pages is None:
        mgr.release_claim(claim)
        return None
    gen = torch.Generator().manual_seed(seed)
    for p in pages:
        mgr.l1.kv[:, :, p] = torch.randn(mgr.l1.kv[:, :, p].shape, generator=gen).to(mgr.l1.kv.dtype)
    mgr.insert_l1(tuple(tokens), pages, claim, start)
    mgr.release_claim(claim)  # duplicates of what L1 already held go back to the free list
    return pages


def l1_bytes(mgr: CacheManager, tokens) -> torch.Tensor:
    """The KV of `tokens` (fully L1 resident) in page order, as raw bytes."""
    m = mgr.tree.match(tokens, include_storage=False, touch=False)
    assert m.lengths[Tier.L1] == len(tokens), m.lengths
    return mgr.l1.kv[:, :, m.pages[Tier.L1]].contiguous().view(torch.uint8).clone()


def assert_whole(mgr: CacheManager) -> None:
    """Integrity, and no tier holds a private page (call after drain with nothing locked)."""
    mgr.check_integrity()
    for tier in TIER_LIST:
        if tier in mgr.tree.allocators:
            alloc = mgr.allocator(tier)
            assert alloc.num_private() == 0, f"{tier.name}: {alloc.num_private()} private pages leaked"
            assert alloc.num_free + alloc.num_tree() == alloc.num_pages
    for node in mgr.tree.iter_nodes():
        if node is not mgr.tree.root:
            assert node.locks == [0, 0, 0], f"{node} still locked: {node.locks}"


def flip_l3_byte(mgr: CacheManager, slot: int, at: int = 5) -> None:
    offset = slot * mgr.store.bytes_per_page + at
    with open(mgr.store.path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@contextlib.contextmanager
def capture_op_logs():
    """capture_logs() with info-level events let through (tests/conftest.py filters below WARNING)."""
    old = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(wrapper_class=old)


def toks(*runs: tuple[int, int]) -> tuple[int, ...]:
    out: list[int] = []
    for lo, hi in runs:
        out.extend(range(lo, hi))
    return tuple(out)


# -- regression tests (each failed before its fix) -------------------------------------------------
@pytest.mark.asyncio
async def test_backup_locks_its_l2_prefix_before_allocating():
    """Bug: start_backup allocated L2 pages (evicting L2 LRU leaves) before locking its own L2
    prefix, so it could evict the very prefix it extends; publishing then broke contiguity and the
    lock raised out of insert_l1 with an L1 lock and private L2 pages leaked."""
    mgr = make_manager(l1_pages=16, host_pages=4, storage_pages=0)
    a, c = toks((0, 8)), toks((500, 504))
    b = a + toks((100, 108))
    write_prefix(mgr, a)
    await mgr.drain()
    write_prefix(mgr, c)  # L2: a (2 pages, older), c (1 page), 1 free
    await mgr.drain()
    write_prefix(mgr, b, start=8)  # needs 2 L2 pages: must evict c, never a
    await mgr.drain()
    m = mgr.tree.match(b, touch=False)
    assert m.lengths[Tier.L2] == 16 and mgr.metrics.failures == {}
    assert mgr.tree.match(c, touch=False).lengths[Tier.L2] == 0
    assert torch.equal(mgr.l2.buffer[:, :, m.pages[Tier.L2]], mgr.l1.kv[:, :, m.pages[Tier.L1]])
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_backup_locks_its_l3_prefix_before_allocating():
    """Bug: the H2S step allocated L3 slots before locking the L3 prefix it extends; the eviction
    took that prefix and the lock then raised (the backup failed as a driver error)."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=4)
    a, c = toks((0, 8)), toks((500, 504))
    b = a + toks((100, 108))
    for t, start in ((a, 0), (c, 0), (b, 8)):
        write_prefix(mgr, t, start)
        await mgr.drain()
    assert mgr.tree.match(b, touch=False).lengths[Tier.L3] == 16
    assert mgr.tree.match(c, touch=False).lengths[Tier.L3] == 0
    assert mgr.metrics.failures == {}
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_l3_restore_locks_its_l2_prefix_before_allocating():
    """Bug: _start_s2h allocated L2 pages before locking the L2 prefix; promoting [8, 16) evicted
    [0, 8) from L2 and publication failed."""
    mgr = make_manager(l1_pages=16, host_pages=4, storage_pages=32)
    a, c = toks((0, 8)), toks((500, 504))
    b = a + toks((100, 108))
    write_prefix(mgr, a)
    await mgr.drain()
    write_prefix(mgr, b, 8)
    await mgr.drain()
    original = l1_bytes(mgr, b)
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 2)  # b's tail leaves L2; a stays (L2: 2 of 4 pages)
    write_prefix(mgr, c)  # L2: a (older), c; 1 free
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 100)
    m = mgr.tree.match(b, touch=False)
    assert m.lengths == [0, 8, 16]
    op = mgr.runner.start_restore(b, m, "l3", "r")
    await mgr.drain()
    assert op.state is OpState.L1_L2_L3, op.error
    assert torch.equal(l1_bytes(mgr, b), original)
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_l3_restore_locks_the_l1_prefix_it_lands_after():
    """Bug: after S2H the restore re-matched L1 (another request may have computed part of the
    prefix meanwhile) and allocated L1 pages without locking that L1 prefix, so the allocation could
    evict it and publishing the restored pages after it raised (an op_driver_error). Now the prefix
    is locked: the allocation fails cleanly and the request recomputes."""
    mgr = make_manager(l1_pages=4, host_pages=32, storage_pages=32, write_policy="write_through_selective")
    a, d = toks((0, 8)), toks((500, 508))
    b = a + toks((100, 108))
    write_prefix(mgr, b)
    mgr.runner.start_backup(b)
    await mgr.drain()
    kv_of_a = mgr.l1.kv[:, :, mgr.tree.match(a, touch=False).pages[Tier.L1]].clone()
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    m = mgr.tree.match(b, touch=False)
    assert m.lengths == [0, 0, 16]
    with capture_op_logs() as logs:
        op = mgr.runner.start_restore(b, m, "l3", "r")
        # before the read lands: a request computes a (same KV), another holds d locked; L1 is full
        claim = mgr.new_claim("w")
        pages = mgr.alloc_l1(2, claim)
        mgr.l1.kv[:, :, pages] = kv_of_a
        mgr.insert_l1(a, pages, claim, 0)
        mgr.release_claim(claim)
        write_prefix(mgr, d)
        reader = mgr.tree.match(d).handles[Tier.L1]
        mgr.lock(reader)
        await mgr.drain()
    assert op.state is OpState.FAILED and op.error == "no L1 pages for the H2D step"
    assert not [e for e in logs if e["event"] == "op_driver_error"]
    assert mgr.metrics.failures == {"no_pages": 1}
    assert mgr.tree.match(a, touch=False).lengths[Tier.L1] == 8  # the unlocked prefix survived
    assert mgr.tree.match(b, touch=False).lengths[Tier.L2] == 16  # the promotion stays published
    mgr.unlock(reader)
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_l3_restore_whose_read_lands_after_l1_was_filled():
    """Bug: a restore whose S2H landed after another restore of the same prefix had published it
    in L1 found nothing left to copy and enqueued an H2D of zero pages, which raised (a spurious
    'driver error' failure and fallback). Two requests with one prefix do this. The interleaving is
    made deterministic by starting the second restore from the match taken before the first ran."""
    mgr = make_manager()
    b = toks((0, 16))
    write_prefix(mgr, b)
    await mgr.drain()
    original = l1_bytes(mgr, b)
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    m = mgr.tree.match(b, touch=False)
    first = mgr.runner.start_restore(b, m, "l3", "r0")
    await mgr.drain()
    second = mgr.runner.start_restore(b, m, "l3", "r1")
    await mgr.drain()
    assert [first.state, second.state] == [OpState.L1_L2_L3] * 2, second.error
    assert mgr.metrics.failures == {} and mgr.metrics.fallbacks == 0
    assert torch.equal(l1_bytes(mgr, b), original)
    assert_whole(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("tier", ["l2", "l3", "prefetch"])
async def test_restore_with_nothing_to_copy_is_refused_cleanly(tier):
    """Bug: start_restore with a stale match (the tier holds no more than L1) enqueued a zero-page
    transfer that raised out of start_restore with the op's L1 lock still held."""
    mgr = make_manager()
    b = toks((0, 16))
    write_prefix(mgr, b)
    await mgr.drain()
    m = mgr.tree.match(b, touch=False)
    assert m.lengths == [16, 16, 16]
    assert mgr.runner.start_restore(b, m, tier, "r") is None
    await mgr.drain()
    assert_whole(mgr)


def test_drop_of_a_multi_node_chain():
    """Bug: RadixTree.drop removed nodes leaves-first, but removing a leaf also removed its emptied
    parent, and the loop then tried to remove that parent again (AssertionError, half-dropped tree)."""
    mgr = make_manager()
    a = toks((0, 8))
    b = a + toks((100, 108))

    async def build():
        write_prefix(mgr, a)
        await mgr.drain()
        write_prefix(mgr, b, 8)
        await mgr.drain()
    asyncio.run(build())
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    m = mgr.tree.match(b, touch=False)
    assert m.lengths == [0, 0, 16] and len(m.path) == 2
    freed = mgr.tree.drop(m.path[0], Tier.L3)
    assert sorted(freed) == sorted(m.pages[Tier.L3])
    assert mgr.tree.match(b).path == [] and not mgr.tree.root.children
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_checksum_mismatch_drops_a_multi_node_l3_chain():
    """The same drop bug through the driver: a bit flip in the first node's slot of a two-node
    L3-only chain made the restore's failure handling crash and leave an empty node behind."""
    mgr = make_manager()
    a = toks((0, 8))
    b = a + toks((100, 108))
    write_prefix(mgr, a)
    await mgr.drain()
    write_prefix(mgr, b, 8)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    m = mgr.tree.match(b, touch=False)
    flip_l3_byte(mgr, m.pages[Tier.L3][0])
    with capture_op_logs() as logs:
        op = mgr.runner.start_restore(b, m, "l3", "r")
        await mgr.drain()
    assert op.state is OpState.FAILED and "checksum" in op.error
    assert [e["to_state"] for e in logs if e["event"] == "op"] == ["S2H_PENDING", "FAILED"]
    assert not [e for e in logs if e["event"] == "op_driver_error"]
    assert mgr.metrics.failures == {"checksum": 1} and mgr.metrics.fallbacks == 1
    assert mgr.tree.match(b, touch=False).lengths == [0, 0, 0]  # the corrupt page's residency is gone
    assert_whole(mgr)

"""Acceptance of "The hierarchy": KV written into L1 pages, backed up to L2 and L3, evicted from L1 and
L2 and restored through L3 -> L2 -> L1 is byte-identical to the original, for both transfer backends
(Triton under the interpreter, torch), page sizes 1 / 4 / 16, float32 and bfloat16, and consecutive or
fragmented destinations in every tier. The structured logs show the exact transitions."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hicache.allocator import PageAllocator
from hicache.faults import Fault, FaultInjector
from hicache.manager import CacheManager
from hicache.ops import OpState
from hicache.radix import Tier
from hicache.transfer_plan import consecutive_runs
from hicache_helpers import assert_whole, capture_op_logs, l1_bytes, make_manager, op_transitions, write_prefix
from test_faults import until

NUM_PAGES = 5  # pages of the prefix under test
TIER_PAGES = 16  # capacity of every tier

BACKUP_PATH = ["L1_PRIVATE", "D2H_PENDING", "L1_L2", "H2S_PENDING", "L1_L2_L3"]
L3_RESTORE_PATH = ["L3", "S2H_PENDING", "L2_L3", "H2D_PENDING", "L1_L2_L3"]
L2_RESTORE_PATH = ["L2", "H2D_PENDING", "L1_L2"]


def one_run(pages: list[int]) -> bool:
    """The pages are consecutive (one DMA run)."""
    return consecutive_runs(pages, max_runs=1) is not None


def fragment(alloc: PageAllocator) -> int:
    """Hold every other page of `alloc` privately, so its free pages have no two neighbours.
    Returns the claim holding them (release it at the end)."""
    claim = alloc.new_claim("fragmenter")
    pages = alloc.alloc(alloc.num_pages, claim)
    alloc.free(pages[::2], claim)
    return claim


def scrub(mgr: CacheManager) -> None:
    """Overwrite every L1 and L2 page that the tree does not own: a restore must really copy."""
    for tier, page_of in ((Tier.L1, lambda p: mgr.l1.kv[:, :, p]), (Tier.L2, lambda p: mgr.l2.page_buffer[p])):
        owned = set(mgr.tree.tree_pages(tier))
        for p in range(mgr.allocator(tier).num_pages):
            if p not in owned:
                page = page_of(p)
                page.copy_(torch.full_like(page, 0).view(torch.uint8).fill_(0xA5).view(page.dtype))


def random_kv(mgr: CacheManager, num_pages: int, seed: int) -> torch.Tensor:
    """Random bytes shaped like `num_pages` L1 pages: [2, L, n, S, H, D] (any bit pattern, NaNs too)."""
    shape = list(mgr.l1.kv[:, :, :num_pages].shape)
    itemsize = mgr.l1.kv.element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape[:-1] + [shape[-1] * itemsize], dtype=torch.uint8, generator=gen)
    return raw.view(mgr.l1.kv.dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", ["consecutive", "fragmented"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
async def test_round_trip_through_every_tier(backend, page_size, dtype, layout):
    mgr = make_manager(l1_pages=TIER_PAGES, host_pages=TIER_PAGES, storage_pages=TIER_PAGES,
                       page_size=page_size, dtype=dtype, transfer_backend=backend)
    assert mgr.backends.gather == backend and mgr.backends.scatter == backend
    fragmenters = {}
    if layout == "fragmented":
        fragmenters = {tier: fragment(mgr.allocator(tier)) for tier in (Tier.L1, Tier.L2, Tier.L3)}
    tokens = tuple(range(1000, 1000 + NUM_PAGES * page_size))
    n_tokens = len(tokens)

    # a request computes the prefix into private L1 pages and publishes it: write-through backs it up
    claim = mgr.new_claim("request")
    l1_pages = mgr.alloc_l1(NUM_PAGES, claim)
    original = random_kv(mgr, NUM_PAGES, seed=page_size)
    mgr.l1.kv[:, :, l1_pages] = original
    with capture_op_logs() as logs:
        mgr.insert_l1(tokens, l1_pages, claim, 0)
        mgr.release_claim(claim)
        await mgr.drain()
    assert list(op_transitions(logs, "backup").values()) == [BACKUP_PATH]
    m = mgr.tree.match(tokens, touch=False)
    assert m.lengths == [n_tokens] * 3
    for tier in (Tier.L1, Tier.L2, Tier.L3):
        assert one_run(m.pages[tier]) == (layout == "consecutive"), (tier, m.pages[tier])
    assert torch.equal(as_bytes(mgr.l2.buffer[:, :, m.pages[Tier.L2]]), as_bytes(original))

    # evict from L1 and L2; nothing of the old bytes survives outside L3
    mgr.tree.evict(Tier.L1, TIER_PAGES)
    mgr.tree.evict(Tier.L2, TIER_PAGES)
    scrub(mgr)
    m = mgr.tree.match(tokens)
    assert m.lengths == [0, 0, n_tokens]

    with capture_op_logs() as logs:
        op = mgr.runner.start_restore(tokens, m, "l3", "req-1")
        await mgr.drain()
    assert op.succeeded, op.error
    assert list(op_transitions(logs).values()) == [L3_RESTORE_PATH]
    m = mgr.tree.match(tokens, touch=False)
    assert m.lengths == [n_tokens] * 3
    assert one_run(m.pages[Tier.L1]) == (layout == "consecutive")
    assert one_run(m.pages[Tier.L2]) == (layout == "consecutive")
    assert torch.equal(as_bytes(mgr.l1.kv[:, :, m.pages[Tier.L1]]), as_bytes(original))
    assert torch.equal(as_bytes(mgr.l2.buffer[:, :, m.pages[Tier.L2]]), as_bytes(original))

    # and once more from L2 alone
    mgr.tree.evict(Tier.L1, TIER_PAGES)
    scrub(mgr)
    m = mgr.tree.match(tokens)
    assert m.lengths == [0, n_tokens, n_tokens]
    with capture_op_logs() as logs:
        op = mgr.runner.start_restore(tokens, m, "l2", "req-2")
        await mgr.drain()
    assert op.succeeded, op.error
    assert list(op_transitions(logs).values()) == [L2_RESTORE_PATH]
    m = mgr.tree.match(tokens, touch=False)
    assert torch.equal(as_bytes(mgr.l1.kv[:, :, m.pages[Tier.L1]]), as_bytes(original))

    for tier, held in fragmenters.items():
        mgr.release_claim(held, tier)
    assert mgr.metrics.failures == {} and mgr.metrics.fallbacks == 0
    assert mgr.metrics.promotions == 1 and mgr.metrics.restores_done == 2
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_partial_hits_restore_only_the_missing_pages():
    """L1 keeps the first pages, L2 a middle part, L3 everything: the restore reads only what L2
    lacks from storage and copies only what L1 lacks to the device, and the result is whole."""
    mgr = make_manager(l1_pages=TIER_PAGES, host_pages=TIER_PAGES, storage_pages=TIER_PAGES, page_size=4)
    a = tuple(range(8))
    b = a + tuple(range(100, 108))
    c = b + tuple(range(200, 208))
    originals = {}
    for seq, start in ((a, 0), (b, 8), (c, 16)):
        claim = mgr.new_claim("request")
        pages = mgr.alloc_l1(2, claim)
        originals[seq] = random_kv(mgr, 2, seed=start)
        mgr.l1.kv[:, :, pages] = originals[seq]
        mgr.insert_l1(seq, pages, claim, start)
        mgr.release_claim(claim)
        await mgr.drain()
    whole = torch.cat([originals[a], originals[b], originals[c]], dim=2)
    mgr.tree.evict(Tier.L1, 4)  # c's and b's pages leave L1 (leaves first)
    mgr.tree.evict(Tier.L2, 2)  # c's pages leave L2
    scrub(mgr)
    m = mgr.tree.match(c)
    assert m.lengths == [8, 16, 24]
    with capture_op_logs() as logs:
        op = mgr.runner.start_restore(c, m, "l3", "req")
        await mgr.drain()
    assert op.succeeded, op.error
    assert list(op_transitions(logs).values()) == [L3_RESTORE_PATH]
    m = mgr.tree.match(c, touch=False)
    assert m.lengths == [24, 24, 24]
    assert torch.equal(as_bytes(mgr.l1.kv[:, :, m.pages[Tier.L1]]), as_bytes(whole))
    s2h, h2d = mgr.metrics.directions["s2h"], mgr.metrics.directions["h2d"]
    assert s2h.num_bytes == 2 * mgr.geometry.bytes_per_page  # only c's pages came from storage
    assert h2d.num_bytes == 4 * mgr.geometry.bytes_per_page  # b's and c's pages went to L1
    assert_whole(mgr)
    await mgr.close()


def gate_transfer_waits(mgr: CacheManager):
    """Every wait for a transfer is recorded and held until the returned event is set. Returns
    (that event, the transfers waited for, the real wait to put back)."""
    gate, waited, real_wait = asyncio.Event(), [], mgr.transfer.wait

    async def gated_wait(tr):
        waited.append(tr)
        await gate.wait()
        return await real_wait(tr)

    mgr.transfer.wait = gated_wait
    return gate, waited, real_wait


@pytest.mark.asyncio
async def test_a_restore_cancelled_before_its_driver_ran_holds_its_pages_until_the_copy_settled():
    """The driver task of an L2 restore is cancelled before it ever ran, so it never waited for
    its copy, which on CUDA is enqueued by then and may still be in flight. Its L1 pages must stay
    held until that copy has settled, then go back whole; freeing them at once (as before) let
    another owner take pages a late copy still writes."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    tokens = tuple(range(100, 124))  # 6 pages
    assert write_prefix(mgr, tokens) is not None  # publishing starts the write-through backup
    await mgr.drain()  # the prefix is in L2
    mgr.tree.evict(Tier.L1, 16)
    m = mgr.tree.match(tokens)
    assert m.lengths[:2] == [0, len(tokens)]
    gate, waited, _ = gate_transfer_waits(mgr)
    op = mgr.runner.start_restore(tokens, m, "l2", "req", layerwise=True)
    assert op is not None
    mgr.runner._tasks[op.op_id].cancel()  # before the loop ever ran it
    free_before = mgr.allocator(Tier.L1).num_free
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(waited) == 1  # the settle waits for the op's copy ...
    assert mgr.allocator(Tier.L1).num_free == free_before  # ... and holds the pages meanwhile
    gate.set()
    await mgr.drain()
    assert op.done and not op.succeeded
    assert mgr.allocator(Tier.L1).num_free == free_before + 6
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_backup_cancelled_before_its_driver_ran_holds_its_pages_and_lets_the_next_one_start():
    """Same for a write-through backup: its L2 pages stay held until its D2H settled, and its
    tokens no longer count as being backed up (the driver's own cleanup never ran), so the next
    backup of them starts."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    tokens = tuple(range(200, 224))  # 6 pages
    gate, waited, real_wait = gate_transfer_waits(mgr)
    free_before = mgr.allocator(Tier.L2).num_free
    assert write_prefix(mgr, tokens) is not None  # publishing starts the write-through backup
    [op] = mgr.runner.live.values()
    assert op.kind.value == "backup" and mgr.allocator(Tier.L2).num_free == free_before - 6
    mgr.runner._tasks[op.op_id].cancel()  # before the loop ever ran it
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(waited) == 1 and mgr.allocator(Tier.L2).num_free == free_before - 6
    gate.set()
    await mgr.drain()
    assert op.done and not op.succeeded
    assert mgr.allocator(Tier.L2).num_free == free_before
    mgr.transfer.wait = real_wait
    again = mgr.runner.start_backup(tokens, "writer")  # not refused as "already in flight"
    assert again is not None
    await mgr.drain()
    assert again.succeeded
    assert mgr.tree.match(tokens, touch=False).lengths[Tier.L2] == len(tokens)
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_taken_prefetch_keeps_duplicate_l2_pages_until_its_copy_settled():
    """A prefetch taken on to L1 while verifying publishes its L2 pages when the checksums pass,
    while its H2D may still be reading them. If another op published the same tokens in L2 first,
    its pages are duplicates: they stay the op's (not on a free list, where a backup could reuse
    them under the copy) until the H2D settled, and are freed then; L1 gets the right bytes."""
    faults = FaultInjector()
    mgr = make_manager(faults=faults)
    tokens = tuple(range(500, 500 + 4 * mgr.page_size))
    write_prefix(mgr, tokens, seed=3)
    await mgr.drain()
    want = l1_bytes(mgr, tokens)
    mgr.tree.evict(Tier.L1, mgr.l1.num_pages)
    mgr.tree.evict(Tier.L2, mgr.l2.num_pages)
    assert mgr.tree.match(tokens, touch=False).lengths == [0, 0, len(tokens)]
    faults.arm(Fault.SLOW_VERIFY, times=1, delay_s=0.3)  # only the first read's checksums are slow
    first = mgr.runner.start_restore(tokens, mgr.tree.match(tokens), "prefetch", "r1")
    await until(lambda: first.state is OpState.S2H_LANDED)
    release, wait = asyncio.Event(), mgr.transfer.wait

    async def held_wait(tr):  # the H2D's completion is held back (on the CPU copies end when enqueued)
        await release.wait()
        return await wait(tr)
    mgr.transfer.wait = held_wait
    assert mgr.runner.take_to_l1(first, mgr.match(tokens))
    assert first.state is OpState.H2D_VERIFYING
    second = mgr.runner.start_restore(tokens, mgr.tree.match(tokens), "prefetch", "r2")
    await until(lambda: second.done)  # its checksums were quick: its pages were published first
    assert second.succeeded and mgr.tree.match(tokens, touch=False).lengths[Tier.L2] == len(tokens)
    await until(lambda: first.state is OpState.H2D_PENDING)  # checksums passed: PUBLISH_L2 (duplicates)
    assert mgr.allocator(Tier.L2).num_private() == 4  # the duplicates, held under the copy
    mgr.check_integrity()
    release.set()
    await mgr.drain()
    assert first.succeeded, first.error
    assert torch.equal(l1_bytes(mgr, tokens), want)
    assert mgr.allocator(Tier.L2).num_private() == 0
    assert_whole(mgr)
    await mgr.close()

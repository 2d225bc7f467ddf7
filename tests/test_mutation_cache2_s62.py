"""Mutation check (session 62, second pass) of hicache/manager.py and hicache/backups.py: rules no test
pinned, each test named after what a user would notice."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.geometry import KVGeometry
from hicache.manager import CacheManager
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import WriteGate, assert_whole, hold_copies, make_manager, toks, until, write_prefix


def lengths(mgr, *prefixes) -> list[list[int]]:
    return [mgr.tree.match(p, touch=False).lengths for p in prefixes]


def test_a_flush_of_l1_without_a_loop_keeps_write_backs_unsaved_prefixes():
    """Under write_back a flush called with no running loop (nothing can copy) leaves the unsaved
    prefix in L1 instead of dropping it from every tier; a saved one goes."""
    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=0, write_policy="write_back")
    a = toks((0, 8))
    write_prefix(mgr, a)
    assert mgr.flush(Tier.L1) == 0
    assert lengths(mgr, a) == [[8, 0, 0]]


@pytest.mark.asyncio
async def test_a_flush_async_told_not_to_write_back_copies_nothing():
    """flush_async(write_back=False) under write_back (a flush of L2 follows): no backup starts."""
    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=0, write_policy="write_back")
    write_prefix(mgr, toks((0, 8)))
    await mgr.flush_async(Tier.L1, write_back=False)
    assert mgr.metrics.backups_started == 0
    assert mgr.l2.allocator.num_free == 8
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_prompt_chunk_published_without_backup_is_not_backed_up():
    """insert_l1(backup=False) (a prompt chunk's pages) starts no write-through backup now."""
    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=0)
    claim = mgr.new_claim("req")
    pages = mgr.alloc_l1(2, claim)
    mgr.insert_l1(toks((0, 8)), pages, claim, 0, backup=False)
    mgr.release_claim(claim)
    await mgr.drain()
    assert mgr.metrics.backups_started == 0 and lengths(mgr, toks((0, 8))) == [[8, 0, 0]]
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_deferred_backups_wait_for_the_loop_to_turn_twice():
    """With defer_backups (the engine's), a published prefix's backup is queued, not started in the
    step; it starts on the second loop hop (after the step's tokens reached their clients)."""
    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=0)
    mgr.defer_backups = True
    write_prefix(mgr, toks((0, 8)))
    assert mgr.runner.has_due and mgr.metrics.backups_started == 0
    seen = []
    asyncio.get_running_loop().call_soon(lambda: seen.append(mgr.metrics.backups_started))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert seen == [0], "the due backup started on the first hop"
    await mgr.drain()
    assert mgr.metrics.backups_started == 1
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_an_allocation_that_evicts_starts_the_due_backups_first():
    """Due write-through backups start before L1 evicts for an allocation: they lock their pages, so
    the prefix reaches L2 instead of being evicted unsaved; an allocation that fits starts none."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=0)
    mgr.defer_backups = True
    a, b = toks((0, 16)), toks((100, 116))
    write_prefix(mgr, a)
    claim = mgr.new_claim("req")
    assert len(mgr.alloc_l1(4, claim)) == 4  # fits the free list exactly: nothing evicted
    assert mgr.runner.has_due and mgr.metrics.backups_started == 0
    mgr.release_claim(claim)
    write_prefix(mgr, b)
    claim = mgr.new_claim("req")
    assert mgr.alloc_l1(2, claim) is None  # both prefixes are being copied
    mgr.release_claim(claim)
    await mgr.drain()
    assert lengths(mgr, a, b) == [[16, 16, 0], [16, 16, 0]]
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_an_l3_write_is_not_l1_room_coming():
    """A backup whose D2H is done and whose L3 write runs frees no L1 page: backups_copying (and
    l1_room_coming) is False then, so a caller does not wait on it."""
    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=16)
    writes = WriteGate(mgr.store)
    a = toks((0, 8))
    write_prefix(mgr, a)
    await until(lambda: lengths(mgr, a)[0][1] == 8 and mgr.pending_ops() == 1)
    copying = mgr.backups_copying() or mgr.l1_room_coming()
    writes.release()
    await mgr.drain()
    assert not copying
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_write_back_evicts_a_saved_leaf_while_backups_cover_what_the_allocation_wants():
    """Under write_back, backups copying enough pages do not veto saved leaves: an older leaf L2 holds
    is evicted for an allocation while an unsaved leaf's backup is copying."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=0, write_policy="write_back")
    a, c = toks((0, 8)), toks((100, 116))
    write_prefix(mgr, a)
    mgr.runner.start_backup(a)
    await mgr.drain()
    write_prefix(mgr, c)
    gate = hold_copies(mgr)
    mgr.runner.start_backup(c)
    claim = mgr.new_claim("req")
    got = mgr.alloc_l1(4, claim)
    gate.set()
    mgr.release_claim(claim)
    await mgr.drain()
    assert got is not None and len(got) == 4, "a saved leaf was kept"
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_write_back_backs_up_an_unsaved_leaf_beside_an_l3_write_in_flight():
    """Under write_back an L3 write in flight copies no L1 page: it does not count as a backup on its
    way, so the eviction veto still backs up the unsaved LRU leaf before evicting a saved one."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=32, write_policy="write_back")
    b, a = toks((100, 108)), toks((0, 16))
    write_prefix(mgr, b)
    write_prefix(mgr, a)
    writes = WriteGate(mgr.store)
    op = mgr.runner.start_backup(a)
    await until(lambda: op.state is OpState.H2S_PENDING)
    claim = mgr.new_claim("req")
    got = mgr.alloc_l1(4, claim)
    started = mgr.metrics.backups_started
    writes.release()
    mgr.release_claim(claim)
    await mgr.drain()
    assert got is not None and started == 2, "the unsaved leaf was not backed up"
    assert lengths(mgr, b)[0][1] == 8
    assert_whole(mgr)


def test_a_simulated_manager_keeps_its_cost_priors_and_the_kernel_limit_is_in_pages():
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    cfg = HiCacheConfig(enable=True, host_ratio=2.0, policy="always", transfer_backend="torch")
    sim = CacheManager(geometry, 8, "cpu", cfg, simulate=True)
    assert sim.cost.learning is False
    real = CacheManager(geometry, 8, "cpu", cfg)
    assert real.cost.learning is True
    assert real.transfer.kernel_max_pages == cfg.kernel_restore_max_tokens // 4


def test_write_back_without_an_l2_is_plain_eviction():
    """write_policy write_back with the tiers off: nothing to write back to, L1 evicts as usual."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    mgr = CacheManager(geometry, 8, "cpu", HiCacheConfig(enable=False, write_policy="write_back"))
    assert not mgr.write_back
    write_prefix(mgr, toks((0, 16)))
    claim = mgr.new_claim("req")
    assert len(mgr.alloc_l1(8, claim)) == 8
    mgr.release_claim(claim)


def test_abandon_closes_the_transfer_engine():
    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=16)
    closed, real = [], mgr.transfer.close
    mgr.transfer.close = lambda: closed.append(1) or real()
    mgr.abandon()
    assert closed == [1] and mgr.store.closed


@pytest.mark.asyncio
async def test_a_shared_l3_evicting_its_hints_says_nothing_of_reuse():
    """A content-addressed (shared) L3 dropping a page's local hint does not count as an eviction for
    L3's write admission; a private L3's eviction does."""
    for shared, counted in ((False, 2), (True, 0)):
        mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=16)
        write_prefix(mgr, toks((0, 8)))
        await mgr.drain()
        mgr.store.content_addressed = shared
        mgr.tree.evict(Tier.L3, 2)
        mgr.store.content_addressed = False
        assert mgr.reuse[Tier.L3].evicted_pages == counted


@pytest.mark.asyncio
async def test_a_shutdown_save_of_write_through_saves_a_leaf_never_backed_up():
    """save_for_others under write_through backs up the unsaved L1 leaves too (a refused backup's),
    and ends after a round that saved nothing more (a leaf longer than L2), not at its timeout."""
    mgr = make_manager(l1_pages=16, host_pages=4, storage_pages=32)
    mgr.store.persistent = True
    a, b = toks((0, 8)), toks((100, 124))
    for tokens in (a, b):
        claim = mgr.new_claim("req")
        mgr.insert_l1(tokens, mgr.alloc_l1(len(tokens) // 4, claim), claim, 0, backup=False)
        mgr.release_claim(claim)
    rounds, real = [], mgr.runner.write_back_l1

    async def counted(*args, **kwargs):
        rounds.append(1)
        assert len(rounds) < 5, "rounds went on although the last saved nothing"
        return await real(*args, **kwargs)
    mgr.runner.write_back_l1 = counted
    await mgr.runner.save_for_others(30.0)
    assert lengths(mgr, a)[0][2] == 8 and lengths(mgr, b)[0][2] == 0 and len(rounds) == 2
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_policy_skips_count_refusals_only():
    """A backup that write admission refuses counts a write_l2 skip; one without an L3, or whose
    prefix L3 holds already, counts no write_l3 skip and writes nothing to L3 again."""
    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=0)
    write_prefix(mgr, toks((0, 8)))
    await mgr.drain()
    assert mgr.metrics.policy_skips.get("write_l3", 0) == 0
    mgr.worth_writing = lambda tier, n: False
    write_prefix(mgr, toks((100, 108)))
    await mgr.drain()
    assert mgr.metrics.policy_skips["write_l2"] == 1 and mgr.metrics.backups_started == 1
    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=16)
    a = toks((0, 8))
    write_prefix(mgr, a)
    await mgr.drain()
    mgr.tree.evict(Tier.L2, 2)
    writes, real = [], mgr.store.write_pages
    mgr.store.write_pages = lambda *args, **kwargs: writes.append(1) or real(*args, **kwargs)
    assert mgr.runner.start_backup(a) is not None
    await mgr.drain()
    assert lengths(mgr, a) == [[8, 8, 8]] and writes == []
    assert mgr.metrics.policy_skips.get("write_l3", 0) == 0
    assert mgr.runner.start_backup(a) is None and mgr.metrics.backups_started == 2  # L2 holds it all
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_backups_waiting_for_one_keep_only_the_longest_of_a_chain():
    """Two extensions of one prefix asked while its backup copies (the second extends the first): only
    the longest waits and then copies both tails, in one backup."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    gate = hold_copies(mgr)
    a = toks((0, 8))
    ab = a + toks((100, 104))
    write_prefix(mgr, a)
    write_prefix(mgr, ab, 8)
    write_prefix(mgr, ab + toks((200, 204)), 12)
    gate.set()
    await mgr.drain()
    assert mgr.metrics.backups_started == 2 and lengths(mgr, ab + toks((200, 204))) == [[16, 16, 0]]
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_backup_asked_past_what_l1_holds_copies_what_l1_holds():
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=0)
    a = toks((0, 8))
    write_prefix(mgr, a)
    await mgr.drain()
    mgr.tree.evict(Tier.L2, 2)
    assert mgr.runner.start_backup(a + toks((50, 58))) is not None
    await mgr.drain()
    assert lengths(mgr, a + toks((50, 58))) == [[8, 8, 0]]
    assert mgr.runner.start_backup(a) is None
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_an_l3_writes_op_counts_the_pages_it_writes_and_a_flush_does_not_wait_for_it():
    """L1+L3 hold a, L1 alone its extension: the backup copies 4 pages to L2 and writes 2 to L3; while
    it writes, the op says 2 pages, its D2H has woken an idle loop, and a flush of L1 (not through
    L3) does not wait for the write."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=32)
    a = toks((0, 8))
    ab = a + toks((100, 108))
    write_prefix(mgr, a)
    await mgr.drain()
    mgr.tree.evict(Tier.L2, 2)
    mgr.defer_backups = True
    write_prefix(mgr, ab, 8)
    writes, gate = WriteGate(mgr.store), hold_copies(mgr)
    wakes = []
    mgr.wakeup_idle = lambda: wakes.append(1)
    op = mgr.runner.start_backup(ab)
    mgr.runner._due.clear()
    flush = asyncio.ensure_future(mgr.flush_async(Tier.L1))
    await asyncio.sleep(0)
    gate.set()
    await until(lambda: op.state is OpState.H2S_PENDING)
    num_pages, woken = op.num_pages, len(wakes)
    await until(flush.done)
    writes.release()
    await mgr.drain()
    assert num_pages == 2 and woken >= 1
    assert lengths(mgr, ab) == [[0, 16, 16]]
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_l2_evicts_in_l1_use_order_not_backup_order():
    """A backup's L2 pages carry its L1 pages' last use: a prefix used after both backups started is
    evicted from L2 after the other one, whichever copy landed first."""
    mgr = make_manager(l1_pages=8, host_pages=4, storage_pages=0)
    a, b = toks((0, 8)), toks((100, 108))
    gate = hold_copies(mgr)
    write_prefix(mgr, a)
    write_prefix(mgr, b)
    mgr.tree.match(a)  # a used again
    gate.set()
    await mgr.drain()
    mgr.tree.evict(Tier.L2, 2)
    assert lengths(mgr, a, b) == [[8, 8, 0], [8, 0, 0]]
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_write_back_flush_backs_up_leaves_not_their_shared_prefix_apart():
    """write_back_l1 backs up the unsaved leaves (their prefixes come with them): two prompts sharing a
    page that L2 lacks take two backups, not a third of the shared page alone."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=0, write_policy="write_back")
    x, y = toks((0, 4), (10, 14)), toks((0, 4), (20, 24))
    write_prefix(mgr, x)
    write_prefix(mgr, y, 4)
    await mgr.flush_async(Tier.L1)
    assert mgr.metrics.backups_started == 2
    assert lengths(mgr, x, y) == [[0, 8, 0], [0, 8, 0]]
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_an_l3_write_of_one_page_is_waited_for_by_its_extensions():
    """The L3 write in flight of a one-page prefix writes the page after L3's end of its extension:
    the extension's L3 write waits for it and then writes only its own tail (the page once)."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64)
    writes = WriteGate(mgr.store)
    sizes, held = [], mgr.store.write_pages
    mgr.store.write_pages = lambda buf, src, slots, **kw: sizes.append(len(slots)) or held(buf, src, slots, **kw)
    gate = hold_copies(mgr)
    s = toks((0, 4))
    ext = s + toks((100, 108))
    write_prefix(mgr, s)
    write_prefix(mgr, ext, 4)  # deferred behind s's backup
    gate.set()
    await until(lambda: lengths(mgr, ext)[0][1] == 12)
    for _ in range(20):
        await asyncio.sleep(0)
    issued = list(sizes)
    writes.release()
    await mgr.drain()
    assert issued == [1], f"the extension wrote the prefix's page beside its write: {issued}"
    assert sizes == [1, 2] and lengths(mgr, ext) == [[12, 12, 12]]
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_l3_paused_for_room_skips_its_writes_before_the_cost_model_is_asked():
    """While L3 backs off writes (an ENOSPC), a backup skips its L3 write, a write_l3 skip, without
    asking L3's write admission (its probes stay for writes), as does an L2-refused backup's L3 probe."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=32)
    mgr.store.write_retry_in_s = lambda: 1.0
    asked, real = [], mgr.worth_writing
    mgr.worth_writing = lambda tier, n: asked.append(tier) or real(tier, n)
    a = toks((0, 8))
    write_prefix(mgr, a)
    await mgr.drain()
    assert lengths(mgr, a) == [[8, 8, 0]] and mgr.metrics.policy_skips["write_l3"] == 1
    mgr.backup_worth_its_cost = lambda n: False
    write_prefix(mgr, toks((100, 108)))
    await mgr.drain()
    assert "l3" not in asked, asked
    assert_whole(mgr)


def test_an_l2_of_no_page_is_refused_naming_the_flags():
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    cfg = HiCacheConfig(enable=True, host_size_gb=geometry.bytes_per_page / 2 / (1 << 30), transfer_backend="torch")
    with pytest.raises(ValueError, match="L2 would hold no page"):
        CacheManager(geometry, 8, "cpu", cfg)

"""Mutation check of the cache's core (session 56, core2): the manager's flush and write-back eviction
veto, the backup drivers' L3 step, the op runner's cleanup of a cancelled driver, and the other rules
that no earlier test pinned. Each test states the behaviour it guards."""
from __future__ import annotations

import dataclasses

import pytest
import structlog

from hicache.allocator import AllocatorError, PageAllocator
from hicache.faults import Fault, FaultInjector
from hicache.log_gate import info_enabled
from hicache.ops import OpEvent, OpKind, OpState, apply, new_op
from hicache.radix import Tier
from hicache.reuse import TierReuse
from hicache_helpers import (assert_abandoned_read_missed_reused_pages, assert_whole, capture_op_logs,
                             l3_only_prefix_with_slow_reads, make_manager, op_transitions, toks, until,
                             write_prefix)


def _lengths(mgr, tokens) -> list[int]:
    return mgr.tree.match(tokens, touch=False).lengths


# -- flush under write_back ------------------------------------------------------------------------
def test_a_flush_of_l1_with_no_event_loop_keeps_unsaved_write_back_prefixes():
    """Under write_back a prefix L2 and L3 lack lives only in L1. A synchronous flush called where no
    event loop runs cannot start the backup that would save it, so it must leave that prefix in L1
    (nothing freed) instead of dropping it from every tier."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0, write_policy="write_back")
    a = toks((0, 16))
    write_prefix(mgr, a)
    assert mgr.flush(Tier.L1) == 0
    assert _lengths(mgr, a) == [16, 0, 0], "the only copy of an unsaved prefix was dropped"
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_flush_of_l1_told_not_to_write_back_frees_every_unlocked_page_and_copies_nothing():
    """An operator's reset of L1 and L2 together (`flush_async(L1, write_back=False)`, then L2) under
    write_back: the L1 flush must empty L1 at once, not start new backups of the unsaved prefixes
    (their copies would land in the L2 about to be flushed, and the leaves would stay in L1 mid-copy)."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0, write_policy="write_back")
    a, b = toks((0, 16)), toks((100, 108))
    write_prefix(mgr, a, seed=1)
    write_prefix(mgr, b, seed=2)
    assert await mgr.flush_async(Tier.L1, write_back=False) == 6
    assert _lengths(mgr, a) == [0, 0, 0] and _lengths(mgr, b) == [0, 0, 0]
    assert mgr.metrics.backups_started == 0 and not mgr.runner.live
    await mgr.drain()
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_write_back_flush_leaves_a_prefix_in_use_to_its_request():
    """A flush of L1 under write_back backs up the unlocked leaves it will evict; a prefix a running
    request holds locked stays in L1 and is not copied (it is saved when it is evicted later)."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0, write_policy="write_back")
    a, b = toks((0, 16)), toks((100, 108))
    write_prefix(mgr, a, seed=1)
    write_prefix(mgr, b, seed=2)
    held = mgr.match(a).handles[Tier.L1]
    mgr.lock(held)
    assert await mgr.flush_async(Tier.L1) == 2  # b saved, then evicted; a stays
    assert _lengths(mgr, a)[:2] == [16, 0] and _lengths(mgr, b)[:2] == [0, 8]
    assert mgr.metrics.backups_started == 1, "the locked prefix of a running request was copied"
    mgr.unlock(held)
    await mgr.drain()
    assert_whole(mgr)
    await mgr.close()


# -- the write-back eviction veto ------------------------------------------------------------------
@pytest.mark.asyncio
async def test_write_back_eviction_takes_a_saved_leaf_while_an_unsaved_one_is_being_backed_up():
    """Under write_back an allocation that must evict backs up the LRU unsaved leaf (kept in L1 while
    it is copied) and evicts a leaf L2 already holds instead: the allocation gets its pages now,
    it does not come back empty because backups of enough pages were under way."""
    mgr = make_manager(l1_pages=8, host_pages=32, storage_pages=0, write_policy="write_back")
    old, saved = toks((100, 108)), toks((0, 8))  # two pages each; `old` is the least recently used
    write_prefix(mgr, old, seed=1)
    write_prefix(mgr, saved, seed=2)
    assert mgr.runner.start_backup(saved) is not None
    await mgr.drain()
    assert _lengths(mgr, saved)[:2] == [8, 8] and _lengths(mgr, old)[:2] == [8, 0]
    claim = mgr.new_claim("request")
    pages = mgr.alloc_l1(6, claim)  # 4 free: 2 must be evicted
    assert pages is not None and len(pages) == 6, "the saved leaf was kept and the allocation failed"
    assert _lengths(mgr, saved)[:2] == [0, 8]
    assert _lengths(mgr, old)[0] == 8  # kept while its backup copies it
    await mgr.drain()
    assert _lengths(mgr, old)[1] == 8
    mgr.release_claim(claim)
    assert_whole(mgr)
    await mgr.close()


# -- a backup's L3 step ------------------------------------------------------------------------------
async def _in_l1_and_l3_only(mgr, prefix):
    """Publish `prefix` (write_through: backed up to L2 and L3), then flush L2: L1 and L3 hold it."""
    write_prefix(mgr, prefix, seed=3)
    await mgr.drain()
    mgr.flush(Tier.L2)
    assert _lengths(mgr, prefix) == [len(prefix), 0, len(prefix)]


@pytest.mark.asyncio
async def test_a_backup_of_a_prefix_l3_already_holds_writes_nothing_to_l3_and_counts_no_refusal():
    """A write-through backup of a prefix that L3 holds (L2 had evicted it) copies it to L2 and ends
    there: no L3 write of zero pages is issued, and nothing is counted as the policy refusing an L3
    write (operators read policy_skips['write_l3'] as the cost model's refusals)."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64, write_policy="write_through")
    a = toks((0, 8))
    await _in_l1_and_l3_only(mgr, a)
    writes_before = mgr.metrics.directions["h2s"].count
    with capture_op_logs() as logs:
        op = mgr.runner.start_backup(a)
        assert op is not None
        await mgr.drain()
    assert op_transitions(logs, "backup")[op.op_id] == ["L1_PRIVATE", "D2H_PENDING", "L1_L2", "L1_L2_ONLY"]
    assert mgr.metrics.directions["h2s"].count == writes_before
    assert mgr.metrics.policy_skips["write_l3"] == 0
    assert _lengths(mgr, a) == [8, 8, 8]
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_backups_l3_write_is_reported_at_its_own_size():
    """A backup copies to L2 what L2 lacks and writes to L3 what L3 lacks, which may differ: the op's
    events (and the timeline drawn from them) report the L3 write's pages, not the D2H's."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64, write_policy="write_through")
    a = toks((0, 8))
    await _in_l1_and_l3_only(mgr, a)
    ab = a + toks((50, 58))
    with capture_op_logs() as logs:
        write_prefix(mgr, ab, start=len(a), seed=4)  # D2H: 4 pages (L2 lacks all); L3 write: 2 pages
        await mgr.drain()
    sizes = {e["to_state"]: e["pages"] for e in logs if e.get("event") == "op" and e["kind"] == "backup"}
    assert sizes["D2H_PENDING"] == 4
    assert sizes["H2S_PENDING"] == 2 and sizes["L1_L2_L3"] == 2
    assert _lengths(mgr, ab) == [16, 16, 16]
    assert_whole(mgr)
    await mgr.close()


# -- a backup whose driver was cancelled before it ran -----------------------------------------------
@pytest.mark.asyncio
async def test_a_backup_waiting_on_one_whose_driver_was_cancelled_can_be_backed_up_later():
    """A backup that extends one in flight waits for it. If the one in flight has its driver task
    cancelled before it ever ran, the waiting one is dropped with it, but its tokens must not stay
    marked as waiting: a later backup of them starts (else they could never reach L2 again)."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    base = toks((0, 8))
    longer = base + toks((40, 48))
    write_prefix(mgr, base, seed=1)  # write-through: its backup is in flight (not run yet)
    [op] = mgr.runner.live.values()
    write_prefix(mgr, longer, start=len(base), seed=2)  # waits for base's backup
    assert len(mgr.runner.live) == 1
    mgr.runner._tasks[op.op_id].cancel()  # before the loop ever ran it
    await mgr.drain()
    assert op.done and not op.succeeded
    again = mgr.runner.start_backup(longer)
    assert again is not None, "the extension stayed marked as waiting for a backup that is gone"
    await mgr.drain()
    assert _lengths(mgr, longer)[:2] == [16, 16]
    assert_whole(mgr)
    await mgr.close()


# -- L3 reads ----------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_an_l3_read_past_its_deadline_never_lands_in_pages_given_to_someone_else():
    """An L3 restore whose read outlives its deadline fails at once (its request recomputes), but the
    read still runs into the op's L2 pages: they stay reserved until it settled, so a backup that
    needs L2 meanwhile cannot take them and find them overwritten by the late read."""
    mgr, a, b, m = await l3_only_prefix_with_slow_reads()  # reads take 0.3 s; L2 holds 4 pages in all
    mgr.config = dataclasses.replace(mgr.config, io_timeout_s=0.05)
    op = mgr.runner.start_restore(a, m, "l3", "req")
    assert op is not None
    await until(lambda: op.done)
    assert op.state is OpState.FAILED and mgr.metrics.failures.get("timeout") == 1
    await assert_abandoned_read_missed_reused_pages(mgr, op, b)
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_prefetch_counts_as_a_promotion_not_as_a_restore_started():
    """A prefetch (L3 -> L2 only) that no request takes on to L1 is a promotion: the restores-started
    counter, which operators compare with restores done, does not count it."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64)
    a = toks((0, 16))
    write_prefix(mgr, a)
    await mgr.drain()
    mgr.flush(Tier.L1)
    mgr.flush(Tier.L2)
    started = mgr.metrics.restores_started
    m = mgr.match(a)
    assert m.lengths == [0, 0, 16]
    op = mgr.runner.start_restore(a, m, "prefetch", "req")
    assert op is not None
    await mgr.drain()
    assert op.succeeded and _lengths(mgr, a) == [0, 16, 16]
    assert mgr.metrics.promotions == 1
    assert mgr.metrics.restores_started == started
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_request_waits_only_for_another_requests_live_restore_of_its_prefix():
    """Requests sharing a prefix that only L2 holds wait for the one restore in flight instead of
    copying it again, but never for their own restore, nor for one that was cancelled (it will
    publish nothing)."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    a = toks((0, 16))
    write_prefix(mgr, a)
    await mgr.drain()
    mgr.flush(Tier.L1)
    m = mgr.match(a)
    assert m.lengths[:2] == [0, 16]
    op = mgr.runner.start_restore(a, m, "l2", "first")
    assert op is not None
    assert mgr.runner.restore_in_flight(a, m, "second") is op
    assert mgr.runner.restore_in_flight(a, m, "first") is None, "a request waited for its own restore"
    mgr.runner.cancel(op)
    assert mgr.runner.restore_in_flight(a, m, "second") is None, "a request waited for a cancelled restore"
    await mgr.drain()
    assert op.state is OpState.CANCELLED
    assert_whole(mgr)
    await mgr.close()


# -- the tree ----------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_write_through_selective_counts_hits_on_a_prefix_across_a_split():
    """write_through_selective backs a prefix up on its second hit. A prompt used once, then a second
    prompt sharing only its first half, is a second hit on that half (the tree splits the node
    there): the shared half is backed up to L2."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0, write_policy="write_through_selective")
    p = toks((0, 16))
    q = p[:8] + toks((90, 98))
    write_prefix(mgr, p)
    mgr.note_hit(p, mgr.match(p))  # first hit: nothing backed up yet
    await mgr.drain()
    assert _lengths(mgr, p)[:2] == [16, 0]
    m = mgr.match(q)
    assert m.lengths[0] == 8
    mgr.note_hit(q, m)  # second hit on p[:8]
    await mgr.drain()
    assert _lengths(mgr, p[:8])[:2] == [8, 8], "the shared half lost its first hit in the split"
    assert_whole(mgr)
    await mgr.close()


def test_resident_tokens_stop_where_a_prompt_leaves_a_cached_prefix():
    """The scheduler's longest-prefix-match order reads how much of a queued prompt a tier holds. A
    prompt that leaves a cached prefix inside one of its nodes holds only the pages before that
    point, even when its next page happens to be what the cached prefix continues with after the node."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0, write_policy="write_back")  # (no backups)
    ab, cd = toks((0, 8)), toks((100, 108))
    write_prefix(mgr, ab, seed=1)
    write_prefix(mgr, ab + cd, start=len(ab), seed=2)  # a node ab (2 pages) with a child cd
    prompt = ab[:4] + cd[:4] + toks((200, 204))  # ab's first page, then cd's first page
    assert mgr.tree.resident_tokens(prompt, Tier.L1) == 4
    assert mgr.tree.resident_tokens(ab + cd[:4], Tier.L1) == 12


# -- the allocator, write admission and the op log -----------------------------------------------------
def test_allocating_for_a_closed_claim_is_refused_and_takes_no_page():
    """A caller that allocates with a claim it already closed (a bookkeeping bug) gets an
    AllocatorError and the tier loses no page: the free count and free runs stay as they were."""
    alloc = PageAllocator(16, "l1")
    claim = alloc.new_claim("request")
    alloc.close_claim(claim)
    with pytest.raises(AllocatorError):
        alloc.alloc(4, claim)
    assert alloc.num_free == 16
    alloc.check([])
    other = alloc.new_claim("next")
    assert alloc.alloc(16, other) == list(range(16))


def test_write_admission_halves_its_counts_only_once_evictions_pass_the_window():
    """Write admission keeps a window of evictions: both counts halve when evictions pass
    `window_pages`, not when they reach it."""
    r = TierReuse(min_evicted_pages=8, window_pages=32, probe_every=4)
    r.on_read(2)
    r.on_evicted(32)
    assert (r.evicted_pages, r.read_pages) == (32, 2)
    r.on_evicted(1)
    assert (r.evicted_pages, r.read_pages) == (16.5, 1)


def test_write_admission_refuses_a_window_smaller_than_its_evidence_threshold():
    """A window that halves the evictions before they could reach `min_evicted_pages` would never let
    a tier be judged unproductive: such settings are refused."""
    with pytest.raises(ValueError):
        TierReuse(min_evicted_pages=64, window_pages=32)
    TierReuse(min_evicted_pages=32, window_pages=32)  # equal is fine


def test_a_failed_operation_is_logged_under_the_quiet_production_log(monkeypatch):
    """Without --log-json only warnings are kept, and op transitions build no info event; an op that
    fails still logs its warning (with its error), so an operator sees every failure."""
    assert not info_enabled()  # the premise: tests/conftest.py's quiet configuration
    seen = []

    class Recorder:
        def info(self, event, **fields):
            seen.append(("info", event, fields.get("error")))

        def warning(self, event, **fields):
            seen.append(("warning", event, fields.get("error")))
    monkeypatch.setattr(structlog, "get_logger", lambda *a: Recorder())
    op = new_op(1, OpKind.RESTORE_L2, num_pages=1, num_bytes=64)
    apply(op, OpEvent.START)
    apply(op, OpEvent.FAIL, error="h2d failed")
    assert seen == [("warning", "op", "h2d failed")]


async def _l3_only_with_slow_checks():
    """A manager whose 16-token prefix is in L3 only, its next read's checksums slowed by 0.3 s (the read stays
    landed, S2H_LANDED, a while) -> (mgr, tokens)."""
    faults = FaultInjector()
    mgr = make_manager(faults=faults)
    tokens = toks((500, 516))
    write_prefix(mgr, tokens, seed=3)
    await mgr.drain()
    mgr.flush(Tier.L1)
    mgr.flush(Tier.L2)
    faults.arm(Fault.SLOW_VERIFY, times=1, delay_s=0.3)
    return mgr, tokens


@pytest.mark.asyncio
async def test_a_read_whose_bytes_landed_no_longer_counts_as_storage_reading():
    """The cost model prices a new L3 read behind the reads still in flight (`reading_s`). A prefetch
    whose bytes have landed, only its checksums still running, is no longer in storage's queue: it
    adds nothing to that wait."""
    mgr, tokens = await _l3_only_with_slow_checks()  # (its checksums are slow: it stays landed a while)
    op = mgr.runner.start_restore(tokens, mgr.tree.match(tokens), "prefetch", "r1")
    assert op is not None and mgr.runner.reading_s() > 0
    await until(lambda: op.state is OpState.S2H_LANDED)
    assert mgr.runner.reading_s() == 0
    await mgr.drain()
    assert op.succeeded
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_backup_in_flight_is_not_a_pending_restore():
    """The engine counts decode time spent beside restores (metrics restore_overlapped_s) while
    `pending_restores()` is non-zero: a write-through backup in flight is not a restore."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    write_prefix(mgr, toks((0, 16)))  # write-through: its backup is in flight
    assert mgr.pending_ops() == 1
    assert mgr.pending_restores() == 0
    await mgr.drain()
    assert_whole(mgr)
    await mgr.close()


def test_unlocking_a_prefix_no_one_locked_is_refused():
    """A lock protects a prefix a request or a copy reads; unlocking one more time than it was locked
    (a bookkeeping bug) raises at once instead of leaving a negative count that later lets the
    prefix be evicted under a reader."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0, write_policy="write_back")  # (no backups)
    a = toks((0, 8))
    write_prefix(mgr, a)
    handle = mgr.match(a).handles[Tier.L1]
    mgr.lock(handle)
    mgr.unlock(handle)
    with pytest.raises(ValueError):
        mgr.unlock(handle)
    assert handle.locks[Tier.L1] == 0
    mgr.check_integrity()


def test_taking_a_page_one_past_the_end_is_refused_as_an_allocator_error():
    """An adopted L3 index that lists a slot one past the tier's end (a damaged or foreign index)
    is refused with an AllocatorError, taking nothing, like any other slot out of range."""
    alloc = PageAllocator(8, "l3")
    claim = alloc.new_claim("adopted")
    with pytest.raises(AllocatorError):
        alloc.take([3, 8], claim)
    assert alloc.num_free == 8 and alloc.pages_of(claim) == []
    alloc.check([])


def test_an_op_of_a_negative_size_is_refused():
    """An op's pages and bytes are what it copies (its events, the timeline and the cost samples read
    them): a negative count of either is a bug, refused when the op is made."""
    with pytest.raises(ValueError):
        new_op(1, OpKind.BACKUP, num_pages=1, num_bytes=-1)
    with pytest.raises(ValueError):
        new_op(2, OpKind.BACKUP, num_pages=-1, num_bytes=0)
    assert new_op(3, OpKind.BACKUP, num_pages=0, num_bytes=0).state is OpState.L1_PRIVATE


@pytest.mark.asyncio
async def test_status_counts_a_backup_queued_for_after_the_step_as_pending():
    """The engine queues a step's write-through backups until its tokens reached their clients; the
    status an operator reads (`/hicache/status` "pending") counts those queued backups too."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    mgr.defer_backups = True
    write_prefix(mgr, toks((0, 16)))  # queued, not started yet
    assert not mgr.runner.live
    assert mgr.status()["pending"]["backups"] == 1
    await mgr.drain()
    assert mgr.status()["pending"]["backups"] == 0 and _lengths(mgr, toks((0, 16)))[1] == 16
    assert_whole(mgr)
    await mgr.close()


def test_freeing_a_negative_page_index_is_refused_and_frees_nothing():
    """A negative page index (a bookkeeping bug) must not wrap around to the tier's last page: the
    free is refused whole, even when the claim owns that last page."""
    alloc = PageAllocator(4, "l1")
    claim = alloc.new_claim("request")
    assert alloc.alloc(4, claim) == [0, 1, 2, 3]
    with pytest.raises(AllocatorError):
        alloc.free([-1], claim)
    assert alloc.num_free == 0 and alloc.pages_of(claim) == [0, 1, 2, 3]
    alloc.check([])


def test_write_admission_probes_count_afresh_each_time_a_tier_turns_unproductive():
    """An unproductive tier is written only every `probe_every`-th time. Once it was productive again,
    a later unproductive spell starts a new count: its first probe comes after `probe_every` asks,
    not early with declines left over from the spell before."""
    r = TierReuse(min_evicted_pages=8, window_pages=1024, probe_every=4)
    r.on_evicted(8)
    assert [r.admit() for _ in range(3)] == [False, False, False]
    r.on_read(8)  # read back: productive
    assert r.admit()
    r.on_evicted(1000)  # unproductive again
    assert [r.admit() for _ in range(4)] == [False, False, False, True]


def test_the_halves_of_a_split_node_keep_their_age_for_eviction():
    """Matching a prompt that shares part of a cached prefix splits its node without using it (a
    backup's look-up). Both halves keep the prefix's last use: an older prefix is still evicted
    before the newer prefix's first half, which does not become the oldest page of the tier."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0, write_policy="write_back")  # (no backups)
    old, new = toks((0, 8)), toks((100, 116))
    write_prefix(mgr, old, seed=1)
    write_prefix(mgr, new, seed=2)  # used after `old`
    mgr.tree.match(new[:8] + toks((200, 204)), touch=False)  # splits `new` at 8 tokens
    held = mgr.tree.match(old, touch=False).handles[Tier.L1]
    mgr.lock(held)  # `old` in use: the next eviction takes new's second half
    assert mgr.tree.evict(Tier.L1, 2) == 2
    mgr.unlock(held)
    assert _lengths(mgr, new)[0] == 8
    assert mgr.tree.evict(Tier.L1, 2) == 2  # the least recently used now: `old`
    assert _lengths(mgr, old)[0] == 0 and _lengths(mgr, new)[0] == 8, "the newer prefix's half went first"
    mgr.check_integrity()


@pytest.mark.asyncio
async def test_a_bug_in_an_op_driver_is_counted_and_leaks_no_page(monkeypatch):
    """A driver that raises (a bug) must not leak pages or locks nor go unnoticed: the op fails, its
    pages go back, and failures['driver'] counts it for the operator (and the tests' checks)."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)

    def broken(*args, **kwargs):
        raise RuntimeError("bug")
    monkeypatch.setattr(mgr.runner, "_publish", broken)
    a = toks((0, 16))
    write_prefix(mgr, a)  # write-through: its backup's driver raises as it publishes
    [op] = mgr.runner.live.values()
    await mgr.drain()
    assert op.state is OpState.FAILED and mgr.metrics.failures.get("driver") == 1
    assert mgr.allocator(Tier.L2).num_free == 32 and mgr.allocator(Tier.L2).num_private() == 0
    assert mgr.match(a).handles[Tier.L1].locks[Tier.L1] == 0
    mgr.check_integrity()
    await mgr.close()


@pytest.mark.asyncio
async def test_a_prefetch_taken_on_to_l1_counts_as_one_restore_started_and_done():
    """A prefetch that its request takes on to L1 (its read landed, checksums still running) becomes a
    restore: restores started and restores done both count it once, so started minus done stays the
    number of restores under way."""
    mgr, tokens = await _l3_only_with_slow_checks()
    started, done = mgr.metrics.restores_started, mgr.metrics.restores_done
    op = mgr.runner.start_restore(tokens, mgr.tree.match(tokens), "prefetch", "r1")
    await until(lambda: op.state is OpState.S2H_LANDED)
    assert mgr.runner.take_to_l1(op, mgr.match(tokens))
    await mgr.drain()
    assert op.succeeded and _lengths(mgr, tokens) == [16, 16, 16]
    assert (mgr.metrics.restores_started - started, mgr.metrics.restores_done - done) == (1, 1)
    assert_whole(mgr)
    await mgr.close()

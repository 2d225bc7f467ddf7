"""Cache-core rules found unwatched by session 67's mutation check (the leftovers of session 66's check of
hicache/radix.py, restores.py and operations.py, and a fresh one of scheduler/admission.py). The tree: a match
without storage neither reports nor stamps L3. The restores: a cancelled read is no longer priced as a read in
flight, and an L3 restore cancelled while it waits for L1 room ends without an H2D. The drivers: a copy whose
asynchronous enqueue compiled a kernel is no cost sample, only write_back remembers failed backups, an op already
ended is not cancelled again, a cancelling drain drops the backups queued to start soon, and a driver's end wakes
the loop once. Admission: a request waits for its shared-L3 hints, a prefetch that failed before its request was
tried is settled (a fallback), every prefill pass notes the load, and a request waits for a sharer only where that
one still has the threshold to compute past what it published, in whole pages. Each test names its mutant."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpEvent, OpKind, OpState, apply
from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, toks, write_prefix
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from test_mutation_l3_s61 import _runner
from test_prefetch_accounting_s60 import _landed_prefetch
from test_radix import make_tree, put
from test_room_coming_s55_hunt import restore_waiting_for_room


def test_a_match_without_storage_neither_reports_nor_stamps_l3():
    """`match(include_storage=False)` (a publish's, a take-on's) leaves L3 out: no L3 length, handle or pages, and
    no L3 stamp, so publishing a prefix just used does not make L3 keep it over one read since (R3)."""
    tree, allocs = make_tree()
    a = list(range(16))
    put(tree, allocs, a, Tier.L1)
    put(tree, allocs, a, Tier.L3)
    node = tree.match(a, touch=False).handles[Tier.L3]
    before = list(node.stamp)
    m = tree.match(a, include_storage=False)
    assert m.lengths[Tier.L1] == 16
    assert m.lengths[Tier.L3] == 0 and m.handles[Tier.L3] is None and not m.pages[Tier.L3]
    assert node.stamp[Tier.L3] == before[Tier.L3]
    assert node.stamp[Tier.L1] > before[Tier.L1]


@pytest.mark.asyncio
async def test_a_cancelled_read_is_no_longer_priced_as_a_read_in_flight():
    """A prefetch cancelled (its request aborted) while its bytes are still on their way reads for no one:
    `reading_s` no longer prices it, though its read goes on until it settles, so a new L3 read is not
    judged queued behind it (S17)."""
    faults = FaultInjector()
    faults.arm(Fault.SLOW_READ, delay_s=0.3)
    mgr, tokens, op = await _landed_prefetch(faults)
    assert op.state is OpState.S2H_PENDING and mgr.runner.reading_s() > 0
    mgr.runner.cancel(op)
    assert op.state is OpState.S2H_PENDING and mgr.runner.reading_s() == 0.0
    await mgr.drain()
    mgr.check_integrity()
    await mgr.close()


@pytest.mark.asyncio
async def test_an_l3_restore_cancelled_while_it_waits_for_l1_room_ends_without_an_h2d():
    """An L3 restore whose read landed waits for the L1 room a backup's copy frees (`l1_room_coming`); cancelled
    meanwhile (its request aborted), it ends once that room came, cancelled, and copies nothing into L1 for no
    one (S40: it started the H2D, allocating L1 pages and evicting for it)."""
    w = await restore_waiting_for_room()
    mgr, a, restore, copies, claim, held = w.mgr, w.a, w.restore, w.copies, w.claim, w.held
    mgr.runner.cancel(restore)  # (it waits for the room: its driver sleeps on l1_room_saved)
    copies.release.set()
    await mgr.drain()
    assert restore.error == "cancelled", (restore.state, restore.error)
    assert OpState.H2D_PENDING not in [state for state, _ in restore.history]
    assert mgr.tree.match(a, touch=False).lengths[Tier.L1] == 0
    mgr.release_claim(claim)
    del held
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_copy_whose_asynchronous_enqueue_compiled_a_kernel_is_no_cost_sample():
    """A backup's D2H whose asynchronous enqueue took JIT_ENQUEUE_NS or more compiled a kernel (a one-time cost):
    the cost model does not learn the link from it; the next copy, a plain one, it learns (O15: `learnable` was
    pinned alone, not that the driver asks it)."""
    from hicache.operations import JIT_ENQUEUE_NS
    mgr = make_manager()
    seen = []
    mgr.cost.observe_transfer = lambda direction, num_bytes, seconds: seen.append(direction)
    d2h = mgr.transfer.d2h

    def compiling(*args, **kwargs):
        tr = d2h(*args, **kwargs)
        tr.synchronous, tr.enqueue_ns = False, 2 * JIT_ENQUEUE_NS
        return tr
    mgr.transfer.d2h = compiling
    write_prefix(mgr, toks((0, 8)))
    await mgr.drain()
    assert mgr.tree.match(toks((0, 8)), touch=False).lengths[Tier.L2] == 8  # (it was copied)
    assert "d2h" not in seen
    mgr.transfer.d2h = d2h
    write_prefix(mgr, toks((100, 108)))
    await mgr.drain()
    assert seen.count("d2h") == 1
    await mgr.close()


@pytest.mark.parametrize("write_back", [False, True])
def test_only_write_back_remembers_a_failed_backup(write_back):
    """A failed backup's L1 node is remembered for write_back's eviction veto only (`write_back_keep`, the one
    reader): under the other policies nothing is kept (O12: every failed backup's entry kept for nothing)."""
    metrics = SimpleNamespace(count_failure=lambda kind: None)
    runner = _runner(write_back=write_back, tree=SimpleNamespace(tick=7), metrics=metrics,
                     geometry=SimpleNamespace(bytes_per_page=1))
    op = runner._new(OpKind.BACKUP, 1, None)
    apply(op, OpEvent.START)
    op.payload["backup_node"] = 5
    runner._fail(op, "eio", "eio")
    assert runner._backup_failed == ({5: 7} if write_back else {})


def test_an_op_that_already_ended_is_not_cancelled_again():
    """`_cancelled` at a driver's step: an op asked to stop that has already ended (failed) is left as it ended,
    nothing released or counted twice (O13: a CANCEL applied to a done op raised IllegalTransition)."""
    metrics = SimpleNamespace(count_failure=lambda kind: None, cancellations=0)
    runner = _runner(write_back=False, tree=SimpleNamespace(tick=7), metrics=metrics,
                     geometry=SimpleNamespace(bytes_per_page=1))
    op = runner._new(OpKind.BACKUP, 1, None)
    apply(op, OpEvent.START)
    runner._fail(op, "eio", "eio")
    op.payload["cancel"] = True
    assert not runner._cancelled(op)
    assert op.state is OpState.FAILED and op.error == "eio" and metrics.cancellations == 0


@pytest.mark.asyncio
async def test_a_drain_that_cancels_drops_the_backups_queued_to_start_soon():
    """`backup_soon` queues a backup for after the step's tokens went out; a drain that cancels (a shutdown)
    drops it with the rest: its hop, or the next match, starts nothing (O30: it was kept and started after the
    drain, onto tiers being closed)."""
    mgr = make_manager(write_policy="write_back")  # (publishing backs nothing up by itself)
    a = toks((0, 8))
    write_prefix(mgr, a)
    mgr.runner.backup_soon(a)
    assert mgr.runner.has_due
    await mgr.runner.drain(cancel=True)
    assert not mgr.runner.has_due
    mgr.runner.start_due()  # (as its hop, or the next match, would)
    await mgr.drain()
    assert mgr.metrics.backups_started == 0
    assert mgr.tree.match(a, touch=False).lengths[Tier.L2] == 0
    await mgr.close()


@pytest.mark.asyncio
async def test_a_restore_ending_wakes_the_loop_once():
    """A driver's end unlists its op and wakes the loop once, though both its guard's `finally` and its task's
    done-callback tell it (`_forget`); a second `wakeup` would end a decode chain formed in between for nothing
    (O32)."""
    mgr = make_manager()
    a = toks((0, 8))
    write_prefix(mgr, a)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 2)
    m = mgr.match(a)
    assert m.lengths[:2] == [0, 8]
    woken = []
    mgr.wakeup = lambda: woken.append("wakeup")
    op = mgr.runner.start_restore(a, m, "l2", "r")
    await mgr.drain()
    assert op.state is OpState.L1_L2 and woken == ["wakeup"], (op.state, woken)
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_request_whose_shared_l3_hints_are_still_coming_is_not_admitted_until_they_came():
    """A shared L3's existence query (`hint_task`) must end before its request is admitted: admitted before,
    it would match a tree without the hints and recompute what the store holds (A5). The next request in the
    queue is admitted meanwhile."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=120))
    first = eng.add_request(list(range(10, 30)), SamplingParams(max_tokens=1))
    second = eng.add_request(list(range(40, 60)), SamplingParams(max_tokens=1))
    first.hint_task = asyncio.get_running_loop().create_future()
    batch = await eng.admission.prefill_batch()
    assert batch is not None and batch.reqs == [second] and list(eng.waiting) == [first]
    first.hint_task.set_result(None)
    batch = await eng.admission.prefill_batch()
    assert batch is not None and first in batch.reqs and not eng.waiting


@pytest.mark.asyncio
async def test_a_prefetch_that_failed_before_its_request_was_tried_is_a_fallback_once_it_recomputes():
    """A request's prefetch that ended (failed) before any prefill pass tried the request is settled there
    (`prefetch_ended`): the request is admitted without it, recomputing what it was to bring, a fallback
    (A7: the stale op stayed on the request and no fallback was counted)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=120))
    req = eng.add_request(list(range(10, 30)), SamplingParams(max_tokens=1))
    req.prefetch_op = SimpleNamespace(done=True, succeeded=False, payload={"l3_end": 16})
    batch = await eng.admission.prefill_batch()
    assert batch is not None and batch.reqs == [req]
    assert req.prefetch_op is None and eng.cache.metrics.fallbacks == 1


@pytest.mark.asyncio
async def test_each_prefill_pass_notes_the_load_its_backups_are_admitted_by():
    """Every prefill pass sets the load that the backups started after it are admitted by (`note_load`), not
    only a decode turn: a pass after a turn of another load must not leave that one's (A12)."""
    from scheduler import load
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=120))
    eng.add_request(list(range(10, 30)), SamplingParams(max_tokens=1))
    eng.cache.busy_s = 123.0  # (what a turn before noted)
    await eng.admission.prefill_batch()
    assert eng.cache.busy_s == load.write_busy_s(eng) != 123.0


def _beside_a_sharer(shared_tokens: int):
    """An engine (page 4) with two requests whose prompts share their first `shared_tokens`: `other` in prefill
    (its cached_len set by the test), `req` queued -> (engine, other, req)."""
    from scheduler.request import RequestState
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=400))
    shared = list(range(100, 100 + shared_tokens))
    other = eng.add_request(shared + list(range(300, 320)), SamplingParams(max_tokens=1))
    req = eng.add_request(shared + list(range(400, 420)), SamplingParams(max_tokens=1))
    eng.waiting.remove(other)
    other.state = RequestState.PREFILL
    eng.running.append(other)
    return eng, other, req


def test_a_request_waits_only_for_a_sharer_with_the_threshold_still_to_compute_beyond_what_it_published():
    """A queued request waits for one in prefill computing its prefix only where that one still has at least
    PREFILL_SHARE_MIN_TOKENS of it to compute past what it published (its `cached_len`): with fewer left,
    waiting a step costs more than computing them alongside (A19: it waited whenever the first 32 agreed)."""
    from scheduler.admission import PREFILL_SHARE_MIN_TOKENS
    eng, other, req = _beside_a_sharer(80)
    other.cached_len = 32  # 48 shared tokens still to compute: wait for them
    assert eng.admission._computes_prefix_of(req) is other
    other.cached_len = 80 - PREFILL_SHARE_MIN_TOKENS + 4  # 28 left: compute alongside
    assert eng.admission._computes_prefix_of(req) is None


def test_the_tokens_a_sharer_must_still_compute_are_counted_in_whole_pages():
    """What a sharer would publish is whole pages: past a `cached_len` between pages (a chunk's end), the
    threshold's end is rounded up to a page, and a prefix ending before it is not waited for (A20)."""
    eng, other, req = _beside_a_sharer(83)
    other.cached_len = 48  # 48 + 32 = 80: within the 83 shared tokens
    assert eng.admission._computes_prefix_of(req) is other
    other.cached_len = 50  # 82, a page up: 84, past them
    assert eng.admission._computes_prefix_of(req) is None

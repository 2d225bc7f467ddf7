"""Abort in every state (session 74 hunt): an op held in one of its pending states (D2H_PENDING,
H2S_PENDING, S2H_PENDING, H2D_PENDING) while an external event the other suites leave unpinned
happens: stop_loop(cancel_ops=True) or shutdown(grace_s=0) under a parked L3 read whose I/O then
succeeds or fails, a cancelling drain under an L2 restore's copy, the source prefix evicted under
pressure from its tier while a backup copies it, and a second request for a prefix an L2 restore
is bringing up. Each checks the op ends (bounded waits), every tier is whole, and a later identical
request's output equals a recompute's. (tests/test_faults_cancellation.py holds the abort and
shutdown cells of the fault matrix; tests/test_shutdown_hunt.py the drains of backups.)
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import (WriteGate, assert_whole, capture_op_logs, finish, hold_copies, l1_bytes,
                             make_manager, toks, until, write_prefix)
from test_faults import PROMPT, REUSABLE, TransferGate, ended, live_in, make_engine, only_in_l3, reference, run_one


async def _engine_with_prompt_in_l3(faults: FaultInjector, **hicache):
    eng = make_engine(faults, **hicache)
    await eng.start()
    await run_one(eng)
    await eng.cache.drain()
    only_in_l3(eng, PROMPT[:REUSABLE])
    return eng


# -- S2H_PENDING: the loop stopped / the engine shut down under a parked request's read ----------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("read_fails", [False, True])
@pytest.mark.parametrize("mode", ["prefetch", "blocking"])
async def test_stop_loop_cancelling_ops_under_a_parked_read_then_start_serves_it(read_fails, mode):
    """stop_loop(cancel_ops=True) while a request waits for its L3 read (held): the read is cancelled,
    the request stays queued and, once start() resumes the loop, is served as a recompute would be."""
    faults = FaultInjector()
    eng = await _engine_with_prompt_in_l3(faults, prefetch=(mode == "prefetch"))
    want = await reference(PROMPT)
    faults.arm(Fault.SLOW_READ, delay_s=0.3)  # (a ReadGate's future hides a verified read's landing)
    if read_fails:
        faults.arm(Fault.EIO_READ)
    with capture_op_logs() as logs:
        task = asyncio.create_task(run_one(eng))
        await until(lambda: live_in(eng, OpState.S2H_PENDING))
        [op] = live_in(eng, OpState.S2H_PENDING)
        stopping = asyncio.create_task(eng.stop_loop(cancel_ops=True))
        await until(lambda: op.payload["cancel"] or op.done)
        await asyncio.wait_for(stopping, 10)
        assert op.done and not eng.cache.runner.live
    # (a blocking restore the loop waited for may end first; a failing read may end FAILED before the cancel)
    assert [e["from_state"] for e in ended(logs, "CANCELLED") + ended(logs, "FAILED")] in ([], ["S2H_PENDING"])
    assert_whole(eng.cache)
    await eng.start()
    result = await asyncio.wait_for(task, 10)
    assert result.finish_reason == "length" and result.output_ids == want
    await eng.cache.drain()
    assert_whole(eng.cache)
    assert (await run_one(eng)).output_ids == want
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("read_fails", [False, True])
async def test_shutdown_without_grace_under_a_parked_read_aborts_its_request(read_fails):
    """shutdown(grace_s=0) while a request waits for its L3 read (held), which then lands or fails:
    the request ends "abort" with no output, the op CANCELLED, and every tier is whole."""
    faults = FaultInjector()
    eng = await _engine_with_prompt_in_l3(faults)
    faults.arm(Fault.SLOW_READ, delay_s=0.3)  # (a ReadGate's future hides a verified read's landing)
    if read_fails:
        faults.arm(Fault.EIO_READ)
    with capture_op_logs() as logs:
        task = asyncio.create_task(run_one(eng))
        await until(lambda: live_in(eng, OpState.S2H_PENDING))
        [op] = live_in(eng, OpState.S2H_PENDING)
        closing = asyncio.create_task(eng.shutdown(grace_s=0))
        await until(lambda: op.payload["cancel"] or op.done)
        await asyncio.wait_for(closing, 10)
        result = await asyncio.wait_for(task, 10)
    assert result.finish_reason == "abort" and result.output_ids == []
    assert [e["from_state"] for e in ended(logs, "CANCELLED") + ended(logs, "FAILED")] == ["S2H_PENDING"]
    assert not eng.cache.runner.live and not eng.cache.runner._settling
    eng.cache.tree.check_integrity()


# -- H2D_PENDING: a cancelling drain under an L2 restore's copy; a second request for the same prefix -------
@pytest.mark.asyncio
@pytest.mark.parametrize("copy_fails", [False, True])
@pytest.mark.parametrize("source", ["l2", "l3"])
async def test_a_cancelling_drain_under_a_restores_copy_frees_its_l1_pages_after_the_copy(source, copy_fails):
    """drain(cancel=True) while a restore's H2D is held (the copy then succeeds or raises): its L1 pages stay
    reserved until the copy settled, then all go back; the prefix stays in L2 (an L3 restore's read was published
    there) and a later restore from L2 brings the bytes first written."""
    faults = FaultInjector()
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64 if source == "l3" else 0, faults=faults)
    tokens = toks((1, 17))
    write_prefix(mgr, tokens, seed=3)
    want = l1_bytes(mgr, tokens)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 10 ** 9)
    if source == "l3":
        mgr.tree.evict(Tier.L2, 10 ** 9)
        assert mgr.tree.match(tokens, touch=False).lengths == [0, 0, 16]
    free_l1, free_l2 = mgr.allocator(Tier.L1).num_free, mgr.allocator(Tier.L2).num_free
    release = hold_copies(mgr)
    if copy_fails:
        faults.arm(Fault.TRANSFER_RAISE)
    op = mgr.runner.start_restore(tokens, mgr.match(tokens), source, "req")
    await until(lambda: op.state is OpState.H2D_PENDING)
    draining = asyncio.create_task(mgr.drain(cancel=True))
    await until(lambda: op.payload["cancel"] or op.done)
    assert mgr.allocator(Tier.L1).num_free < free_l1  # (the copy may still write into them)
    release.set()
    await asyncio.wait_for(draining, 10)
    assert op.state is OpState.CANCELLED or (copy_fails and op.state is OpState.FAILED)
    assert mgr.allocator(Tier.L1).num_free == free_l1
    if source == "l2":
        assert mgr.allocator(Tier.L2).num_free == free_l2
    assert mgr.tree.match(tokens, touch=False).lengths[:2] == [0, 16]
    assert_whole(mgr, driver_errors=0)
    again = mgr.runner.start_restore(tokens, mgr.match(tokens), "l2", "req2")
    await mgr.runner.wait_op(again)
    assert again.succeeded and torch.equal(l1_bytes(mgr, tokens), want)
    await mgr.drain()
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_second_request_for_a_prefix_an_l2_restore_brings_up_shares_it():
    """Two requests for one L2-only prefix, the second arriving while the first's H2D is held: one
    restore, not two page sets; both outputs equal a recompute's."""
    eng = make_engine(prefetch=False)
    await eng.start()
    want = await reference(PROMPT)
    await run_one(eng)
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    assert eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).lengths[:2] == [0, REUSABLE]
    gate, before = TransferGate(eng, "h2d"), eng.cache.metrics.restores_started
    first = asyncio.create_task(run_one(eng))
    await until(lambda: live_in(eng, OpState.H2D_PENDING))
    second = asyncio.create_task(run_one(eng))
    await until(lambda: len(eng.requests) == 2)
    for _ in range(20):  # (the loop looks at the second request while the first's copy is held)
        await asyncio.sleep(0.005)
    assert live_in(eng, OpState.H2D_PENDING)
    gate.release.set()
    results = await asyncio.wait_for(asyncio.gather(first, second), 10)
    await eng.cache.drain()
    assert eng.cache.metrics.restores_started - before == 1, "the second request restored the prefix again"
    assert [r.output_ids for r in results] == [want, want]
    assert_whole(eng.cache)
    await finish(eng)


# -- D2H_PENDING / H2S_PENDING: the source prefix evicted under pressure while a backup copies it -----------
@pytest.mark.asyncio
@pytest.mark.parametrize("state", ["D2H_PENDING", "H2S_PENDING"])
@pytest.mark.parametrize("io_fails", [False, True])
async def test_evicting_a_backups_source_tier_keeps_its_locked_source(state, io_fails):
    """Everything evictable in a backup's source tier evicted while its copy is held (then it succeeds
    or fails): the locked source stays, and what the backup publishes matches how its copy ended."""
    faults = FaultInjector()
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64, faults=faults)
    tokens = toks((1, 17))
    if state == "D2H_PENDING":
        release = hold_copies(mgr).set
        if io_fails:
            faults.arm(Fault.TRANSFER_RAISE)
        source = Tier.L1
    else:
        release = WriteGate(mgr.store).release
        if io_fails:
            faults.arm(Fault.EIO_WRITE)
        source = Tier.L2
    write_prefix(mgr, tokens, seed=4)
    want = l1_bytes(mgr, tokens)
    await until(lambda: any(op.state is OpState[state] for op in mgr.runner.live.values()))
    mgr.tree.evict(source, 10 ** 9)  # pressure: everything evictable in the source tier goes
    mgr.check_integrity()
    assert mgr.tree.match(tokens, touch=False).lengths[source] == 16, "a locked source was evicted"
    release()
    await asyncio.wait_for(mgr.drain(), 10)
    assert_whole(mgr)
    lengths = mgr.tree.match(tokens, touch=False).lengths
    assert lengths[Tier.L1] == 16 and lengths[Tier.L2] == (0 if state == "D2H_PENDING" and io_fails else 16)
    assert lengths[Tier.L3] == (16 if not io_fails else 0)
    assert torch.equal(l1_bytes(mgr, tokens), want)
    await mgr.close()

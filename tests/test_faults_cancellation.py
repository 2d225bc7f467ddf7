"""The cancellation cells of the fault matrix (tests/test_faults.py holds the fault cells and the
harness), through the real Engine (tiny preset, CPU, all three tiers): an abort of the request while
its restore is pending, shutdown while a backup is pending, an abort of every request while an op is
held in each pending state, an op's asyncio task cancelled, and an engine that stays down once shut
down. Each checks that the op ends CANCELLED from the targeted state (`cancellations` counted), that
every tier's pages are whole once the copies settled, and that the engine serves on (or refuses) as
it should. docs/reliability.md has these cells in its table.
"""
from __future__ import annotations

import asyncio

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import WriteGate, assert_whole, capture_op_logs, finish, until
from scheduler.request import RequestError, SamplingParams
from test_faults import (OTHER, PROMPT, REUSABLE, TransferGate, ended, live_in, make_engine, only_in_l3, reference,
                         run_one)


# -- cancellation cells --------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("state", ["S2H_PENDING", "H2D_PENDING"])
async def test_abort_cancels_a_pending_restore(state):
    """engine.abort while the request's restore is pending: the op ends CANCELLED once its copy
    settled, its private pages are freed, and the same prompt later completes normally."""
    faults = FaultInjector()
    eng = make_engine(faults)
    await eng.start()
    want = await reference(PROMPT)
    tokens = PROMPT[:REUSABLE]
    await run_one(eng)
    await eng.cache.drain()
    only_in_l3(eng, tokens)
    gate = None
    if state == "S2H_PENDING":
        faults.arm(Fault.SLOW_READ, delay_s=0.3)
    else:
        gate = TransferGate(eng, "h2d")
    with capture_op_logs() as logs:
        task = asyncio.create_task(run_one(eng))
        await until(lambda: live_in(eng, OpState[state]))
        [op] = live_in(eng, OpState[state])
        assert await eng.abort(op.request_id)
        if gate is not None:
            await until(lambda: op.payload["cancel"])
            gate.release.set()
        result = await task
        await eng.cache.drain()
    assert result.finish_reason == "abort" and result.output_ids == []
    [cancelled] = ended(logs, "CANCELLED")
    assert cancelled["from_state"] == state and cancelled["op_id"] == op.op_id
    assert eng.metrics()["cancellations"] == 1
    assert_whole(eng.cache)
    assert (await run_one(eng)).output_ids == want
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("state", ["D2H_PENDING", "H2S_PENDING"])
async def test_shutdown_cancels_a_pending_backup(state):
    """Backups belong to no request (an abort does not stop them); process-level cancellation is
    shutdown, which cancels pending ops and waits for their copies to settle before freeing."""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT, 1)
    if state == "D2H_PENDING":
        gate = TransferGate(eng, "d2h")
        release = gate.release.set
    else:
        gate = WriteGate(eng.cache.store)
        release = gate.release
    with capture_op_logs() as logs:
        result = await run_one(eng, max_tokens=1)  # one output token: one backup, at prefill end
        await until(lambda: live_in(eng, OpState[state]))
        [op] = live_in(eng, OpState[state])
        closing = asyncio.create_task(eng.shutdown())
        await until(lambda: op.payload["cancel"])
        release()
        await closing
    assert result.output_ids == want
    [cancelled] = ended(logs, "CANCELLED")
    assert cancelled["from_state"] == state and cancelled["kind"] == "backup"
    assert eng.metrics()["cancellations"] == 1
    assert_whole(eng.cache)
    m = eng.cache.tree.match(PROMPT[:REUSABLE], touch=False)
    assert m.lengths == ([REUSABLE, 0, 0] if state == "D2H_PENDING" else [REUSABLE, REUSABLE, 0])


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["before_it_runs", "while_reading"])
async def test_cancelled_driver_task_keeps_accounting_whole(when):
    """Regression: cancelling an op's asyncio task (not op.cancel()) used to leave its private pages
    claimed forever. Now the op ends CANCELLED and its pages are freed once its read has settled."""
    from hicache_helpers import make_manager, toks, write_prefix

    faults = FaultInjector()
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64, faults=faults)
    tokens = toks((1, 33))  # 32 tokens, 8 pages
    write_prefix(mgr, tokens)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 10 ** 9)
    mgr.tree.evict(Tier.L2, 10 ** 9)
    m = mgr.match(tokens)
    assert m.lengths[Tier.L3] == 32
    faults.arm(Fault.SLOW_READ, delay_s=0.3)
    op = mgr.runner.start_restore(tokens, m, "l3", "req")
    task = mgr.runner._tasks[op.op_id]
    if when == "while_reading":
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert op.state is OpState.CANCELLED and mgr.metrics.cancellations == 1
    await mgr.drain()  # waits for the abandoned read to settle, then frees the pages
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("state,mode", [("D2H_PENDING", "prefetch"), ("H2S_PENDING", "prefetch"),
                                        ("S2H_PENDING", "prefetch"), ("H2D_PENDING", "prefetch"),
                                        ("S2H_PENDING", "blocking"), ("H2D_PENDING", "blocking")])
async def test_abort_during_each_pending_state_keeps_accounting_whole(state, mode):
    """Abort every request while an op is held in `state`: once copies settle, every tier's
    owned + free pages are its capacity, nothing is private, and the engine serves on correctly."""
    faults = FaultInjector()
    eng = make_engine(faults, prefetch=(mode == "prefetch"))
    await eng.start()
    want = await reference(PROMPT)
    tokens = PROMPT[:REUSABLE]
    release = None
    if state in ("S2H_PENDING", "H2D_PENDING"):
        await run_one(eng)
        await eng.cache.drain()
        only_in_l3(eng, tokens)
        if state == "S2H_PENDING":
            faults.arm(Fault.SLOW_READ, delay_s=0.3)
        else:
            release = TransferGate(eng, "h2d").release.set
    elif state == "D2H_PENDING":
        release = TransferGate(eng, "d2h").release.set
    else:
        release = WriteGate(eng.cache.store).release
    long_params = SamplingParams(max_tokens=64)
    tasks = [asyncio.create_task(eng.generate_async([p], long_params)) for p in (PROMPT, OTHER)]
    await until(lambda: live_in(eng, OpState[state]))
    for rid in list(eng.requests):
        await eng.abort(rid)
    if release is not None:
        release()
    results = [r for t in tasks for r in await t]
    assert all(r.finish_reason in ("abort", "length") for r in results)
    assert any(r.finish_reason == "abort" for r in results)
    await eng.cache.drain()
    for r in results:  # an aborted request's partial output is a prefix of the recompute
        assert r.output_ids == (await reference(PROMPT if r.prompt_tokens == len(PROMPT) else OTHER,
                                                64))[: len(r.output_ids)]
    assert_whole(eng.cache)
    assert (await run_one(eng)).output_ids == want
    await finish(eng)


# -- found by a bug hunt (session 26) ---------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_shut_down_engine_stays_down():
    """Regression: start() (which submit() and generate_async() call) reset the stop flags and
    started a new loop whenever none was held, and shutdown() drops its loop before it closes the
    tiers: a request submitted while shutdown drained, or after it, was served on closing tiers and
    left a loop running."""
    eng = make_engine()
    await eng.start()
    gate = TransferGate(eng, "d2h")  # the prompt's write-through backup stays in flight
    await run_one(eng, max_tokens=1)
    await until(lambda: live_in(eng, OpState.D2H_PENDING))
    closing = asyncio.create_task(eng.shutdown())
    await until(lambda: eng._loop_task is None)  # shutdown is draining the backup
    with pytest.raises(RequestError, match="shutting down"):
        async for _ in eng.submit(OTHER, SamplingParams(max_tokens=4)):
            pass
    gate.release.set()
    await asyncio.wait_for(closing, 10)
    assert eng._loop_task is None
    [res] = await asyncio.wait_for(eng.generate_async([PROMPT], SamplingParams(max_tokens=4)), 10)
    assert res.finish_reason == "error" and not res.output_ids and eng._loop_task is None

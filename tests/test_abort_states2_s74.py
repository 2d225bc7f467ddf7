"""Abort in every state, part 2 (session 74 hunt; tests/test_abort_states_s74.py holds part 1, and the cancelling
drain's cells of both restores): an L3 restore held in H2D_PENDING (its read done, its copy into L1 held) under
stop_loop() without cancel_ops and shutdown(grace_s=0), the copy then succeeding or raising; a streaming HTTP
client that leaves while its request's op is in S2H_PENDING or H2D_PENDING (L2 and L3 restores), or while its
prefix is being backed up (D2H_PENDING, H2S_PENDING) for an earlier request; and a second request for a prefix
whose L3 read is in S2H_PENDING under stop_loop(). Each checks the op ends (bounded waits), every tier is whole,
and a later identical request's output equals a recompute's.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import ReadGate, WriteGate, assert_whole, capture_op_logs, finish, until
from test_abort_states_s74 import _engine_with_prompt_in_l3
from test_cancel_hunt import FIRST, PARAMS, SECOND, _raw_stream, _until_status
from test_cancel_hunt import make_engine as make_hunt_engine
from test_cancel_hunt import reference as hunt_reference
from test_faults import PROMPT, TransferGate, ended, live_in, op_paths, reference, run_one


# -- H2D_PENDING of an L3 restore: stop_loop(), shutdown(grace_s=0) (its cancelling drain: in part 1) ---------
@pytest.mark.asyncio
@pytest.mark.parametrize("copy_fails", [False, True])
async def test_stop_loop_under_an_l3_restores_held_copy_waits_for_it_then_serves(copy_fails):
    """stop_loop() (no cancel_ops) while a blocking L3 restore's H2D is held: the stop waits for the
    copy; once it settled (or raised) the request is served, or served after start(), as a recompute."""
    faults = FaultInjector()
    eng = await _engine_with_prompt_in_l3(faults, prefetch=False)
    want = await reference(PROMPT)
    gate = TransferGate(eng, "h2d")
    if copy_fails:
        faults.arm(Fault.TRANSFER_RAISE)
    task = asyncio.create_task(run_one(eng))
    await until(lambda: live_in(eng, OpState.H2D_PENDING))
    [op] = live_in(eng, OpState.H2D_PENDING)
    stopping = asyncio.create_task(eng.stop_loop())
    for _ in range(20):  # (the stop waits on the held copy)
        await asyncio.sleep(0.005)
    assert not op.done and not op.payload["cancel"]
    gate.release.set()
    await asyncio.wait_for(stopping, 10)
    assert op.done and not eng.cache.runner.live
    assert op.succeeded is not copy_fails
    assert_whole(eng.cache, driver_errors=0)
    await eng.start()
    result = await asyncio.wait_for(task, 10)
    assert result.finish_reason == "length" and result.output_ids == want
    await eng.cache.drain()
    assert (await run_one(eng)).output_ids == want
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("copy_fails", [False, True])
async def test_shutdown_without_grace_under_an_l3_restores_held_copy_aborts_its_request(copy_fails):
    """shutdown(grace_s=0) while a blocking L3 restore's H2D is held, which then lands or raises: the
    shutdown waits for the copy (the loop waits for a blocking restore; a copy cannot be called back),
    then the request ends "abort" with no output, the op ends once, nothing stays live or settling."""
    faults = FaultInjector()
    eng = await _engine_with_prompt_in_l3(faults, prefetch=False)
    gate = TransferGate(eng, "h2d")
    if copy_fails:
        faults.arm(Fault.TRANSFER_RAISE)
    with capture_op_logs() as logs:
        task = asyncio.create_task(run_one(eng))
        await until(lambda: live_in(eng, OpState.H2D_PENDING))
        [op] = live_in(eng, OpState.H2D_PENDING)
        closing = asyncio.create_task(eng.shutdown(grace_s=0))
        for _ in range(20):  # (the shutdown waits on the held copy)
            await asyncio.sleep(0.005)
        assert not op.done
        gate.release.set()
        await asyncio.wait_for(closing, 10)
        result = await asyncio.wait_for(task, 10)
    assert result.finish_reason == "abort" and result.output_ids == []
    assert op.done and [e["from_state"] for e in ended(logs, "FAILED")] == (["H2D_PENDING"] if copy_fails else [])
    assert not eng.cache.runner.live and not eng.cache.runner._settling
    eng.cache.tree.check_integrity()


# -- S2H_PENDING: a second request for the prefix the first's L3 read brings up, under stop_loop() -----------
@pytest.mark.asyncio
@pytest.mark.parametrize("cancel_ops", [False, True])
@pytest.mark.parametrize("mode", ["prefetch", "blocking"])
async def test_a_second_request_for_a_prefix_being_read_under_stop_loop(mode, cancel_ops):
    """A second request for an L3-only prefix arrives while the first's read is held in S2H_PENDING,
    then stop_loop() runs: every op ends, and both requests (now, or after start()) equal a recompute;
    without cancel_ops the prefix is read once."""
    faults = FaultInjector()
    eng = await _engine_with_prompt_in_l3(faults, prefetch=(mode == "prefetch"))
    want = await reference(PROMPT)
    faults.arm(Fault.SLOW_READ, delay_s=0.3)
    with capture_op_logs() as logs:
        first = asyncio.create_task(run_one(eng))
        await until(lambda: live_in(eng, OpState.S2H_PENDING))
        [op] = live_in(eng, OpState.S2H_PENDING)
        second = asyncio.create_task(run_one(eng))
        await until(lambda: len(eng.requests) == 2)
        await asyncio.wait_for(eng.stop_loop(cancel_ops=cancel_ops), 10)
        assert op.done and not eng.cache.runner.live
        assert_whole(eng.cache)
        await eng.start()
        results = await asyncio.wait_for(asyncio.gather(first, second), 10)
        await eng.cache.drain()
    assert [(r.finish_reason, r.output_ids) for r in results] == [("length", want)] * 2
    reads = [path for kind, path in op_paths(logs) if kind in ("restore_l3", "prefetch_l3")]
    # (a cancelled read is read again once, after start())
    assert 1 <= len(reads) <= 1 + cancel_ops, f"the prefix was read more than needed: {reads}"
    assert (await run_one(eng)).output_ids == want
    await finish(eng)


# -- a streaming HTTP client that leaves while its request's op (or its prefix's backup) is held ------------
def _held(state: str, engine, s):
    """Hold `state` on the server's loop: (its release, whether an op of that state is live)."""
    if state in ("s2h", "h2s"):
        gate = s.call((ReadGate if state == "s2h" else WriteGate), engine.cache.store)
        release = gate.release
    else:
        gate = s.call(TransferGate, engine, "d2h" if state == "d2h" else "h2d")
        release = lambda: s.loop.call_soon_threadsafe(gate.release.set)  # noqa: E731
    want = {"s2h": OpState.S2H_PENDING, "h2s": OpState.H2S_PENDING, "d2h": OpState.D2H_PENDING}.get(
        state, OpState.H2D_PENDING)
    return release, lambda: s.call(lambda: any(op.state is want for op in engine.cache.runner.live.values()))


STREAM_CELLS = [(state, prefetch) for state in ("s2h", "h2d_l2", "h2d_l3") for prefetch in (True, False)] + [
    ("d2h", True), ("h2s", True)]  # (the backups' cells restore nothing: prefetch plays no part)


@pytest.mark.parametrize("state,prefetch", STREAM_CELLS)
def test_a_stream_whose_client_leaves_under_a_held_op_is_aborted_and_frees_all(state, prefetch):
    """A streaming request whose client leaves while its restore's read (S2H) or copy (H2D, from L2 or
    L3) is held, or, served from L1, while its prefix's write-through backup started by an earlier
    request is held (D2H, H2S): it ends aborted (counted once), the op ends once released, every tier is
    whole, and the same prompt then gives a recompute's output."""
    from test_server import ServerThread

    from scheduler.server import ServerLimits, create_app

    want = asyncio.run(hunt_reference(SECOND))
    engine = make_hunt_engine(num_pages=300, max_running_requests=4, max_new_tokens_limit=1000, prefetch=prefetch)
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        if state in ("d2h", "h2s"):
            release, held = _held(state, engine, s)
            httpx.post(s.url + "/v1/completions", json={"prompt": FIRST, "max_tokens": 2}, timeout=30)
        else:
            httpx.post(s.url + "/v1/completions", json={"prompt": FIRST, "max_tokens": 2}, timeout=30)
            asyncio.run_coroutine_threadsafe(engine.cache.drain(), s.loop).result(30)
            s.call(lambda: (engine.cache.flush(Tier.L1), state != "h2d_l2" and engine.cache.flush(Tier.L2)))
            release, held = _held(state, engine, s)
        try:
            client = _raw_stream(s.url, {"prompt": SECOND, "max_tokens": 1000, "ignore_eos": True})
            _until_status(s.url, lambda st: held() and st["server"]["in_flight"] == 1)
            client.close()
            # (a request the loop waits for in a blocking restore ends at its next tick: aborting till then)
            _until_status(s.url, lambda st: st["engine"]["aborted"] == 1 or s.call(lambda: bool(engine.aborting)))
            assert held(), "the held op ended before the client left"
        finally:
            release()
        st = _until_status(s.url, lambda st: not any(st["engine"][k] for k in ("waiting", "parked", "running"))
                           and not st["server"]["in_flight"] and not any(st["pending"].values()))
        assert st["engine"]["aborted"] == 1 and st["engine"]["finished"] == 1, st["engine"]
        for tier in ("l1", "l2", "l3"):
            t = st["tiers"][tier]
            assert t["private_pages"] == 0 and t["free_pages"] + t["resident_pages"] == t["capacity_pages"], tier
        s.call(engine.check_integrity)
        [out] = asyncio.run_coroutine_threadsafe(engine.generate_async([SECOND], PARAMS), s.loop).result(30)
        assert out.finish_reason == "length" and out.output_ids == want
        asyncio.run_coroutine_threadsafe(engine.cache.drain(), s.loop).result(30)
        s.call(assert_whole, engine.cache)

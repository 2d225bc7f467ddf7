"""Guards for the engine's lifecycle (scheduler/engine_lifecycle.py): rules that session 68's mutation check of
engine_lifecycle.py, loop_task.py, engine_loop.py and reservations.py broke without a failing test. A start() after a
cancelled stop_loop()'s loop ended, start()/stop_loop() queued behind a stop under way, shutdown's grace (new requests
refused; a request left parked by stop_loop(), a continuing client between its requests), a stop-abort that came as
its request ended, and the hits an abort reports for a request queued after its restore landed. No server."""
from __future__ import annotations

import asyncio

import pytest

from hicache_helpers import until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def _engine(**overrides) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", num_pages=256, page_size=4, **overrides))


# -- start / stop / shutdown ----------------------------------------------------------------------
@pytest.mark.asyncio
async def test_start_after_a_cancelled_stop_loops_loop_ended_runs_a_loop_that_admits():
    """stop_loop() whose caller was cancelled leaves the loop stopping; once that loop has ended on its own (its
    running request finished), an abort of a queued request ends it there and then (no loop will tick to settle
    it), and start() runs a new loop that is not stopping: it takes new requests and runs the one left queued (not
    a loop that ends at once, with the engine refusing requests as "stopping" for good)."""
    eng = _engine(max_running_requests=1)
    await eng.start()
    first = eng.add_request([1] * 9, PARAMS)
    queued = eng.add_request([2] * 9, PARAMS)
    doomed = eng.add_request([4] * 9, PARAMS)
    await until(lambda: first in eng.running, 30)
    stop = asyncio.create_task(eng.stop_loop())
    await asyncio.sleep(0)  # (it has begun: the loop is stopping)
    stop.cancel()  # its caller gave up; the loop goes on stopping
    with pytest.raises(asyncio.CancelledError):
        await stop
    old = eng._loop_task
    await until(old.done, 30)  # (its running request finished; the queued one stays queued)
    assert first.finish_reason == "length" and queued in eng.waiting
    assert await eng.abort(doomed.rid)
    assert doomed.finish_reason == "abort" and doomed not in eng.waiting and eng.stats["aborted"] == 1
    await eng.start()
    assert eng.accepting and eng._loop_task is not old
    extra = eng.add_request([3] * 9, PARAMS)
    await until(lambda: queued.state.done and extra.state.done, 60)
    assert (queued.finish_reason, extra.finish_reason) == ("length", "length")
    await eng.shutdown()
    eng.check_integrity()


@pytest.mark.asyncio
async def test_a_new_request_is_refused_in_a_shutdowns_grace():
    """shutdown(grace_s) takes no new requests (only a continuing client's next one): a request added while the
    grace lets a running one finish is refused as "shutting down", and never runs."""
    eng = _engine()
    running = eng.add_request([1] * 9, SamplingParams(max_tokens=40, ignore_eos=True))
    await eng.start()
    await until(lambda: running in eng.running, 30)
    closing = asyncio.ensure_future(eng.shutdown(grace_s=60))
    await until(lambda: eng._closing, 30)
    with pytest.raises(RequestError, match="shutting down"):
        eng.add_request([2] * 9, PARAMS)
    await closing
    assert running.finish_reason == "length" and eng.stats["finished"] == 1


@pytest.mark.asyncio
async def test_a_start_and_a_stop_queued_behind_a_stop_each_wait_for_the_one_before():
    """stop_loop() and start() wait for a stop_loop() under way until none is (not only the one they found): with a
    stop under way and, behind it, start() then stop_loop() then start(), the first start's loop is stopped by the
    second call, the last start() waits for that stop and runs a loop, and every call returns (regression guard: the
    last start() took over the loop the stop behind the first had begun to stop, which then waited forever)."""
    eng = _engine()
    await eng.start()
    running = eng.add_request([1] * 9, PARAMS)
    await until(lambda: running in eng.running, 30)
    first_stop = asyncio.ensure_future(eng.stop_loop())
    await asyncio.sleep(0)  # (it joins the loop: a stop is under way)
    calls = [asyncio.ensure_future(call()) for call in (eng.start, eng.stop_loop, eng.start)]
    await asyncio.wait_for(asyncio.gather(first_stop, *calls), 20)
    assert running.finish_reason == "length"
    assert eng._loop_task is not None and not eng._loop_task.done() and eng.accepting
    later = eng.add_request([2] * 9, PARAMS)
    await until(lambda: later.state.done, 60)
    assert later.finish_reason == "length"
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_shutdowns_grace_runs_a_request_left_parked_by_stop_loop():
    """stop_loop() leaves a request parked on its L3 read as it is; shutdown(grace_s) then runs a loop for it as for
    a queued one: it finishes with its tokens (the read taken), not aborted at once."""
    from hicache.radix import Tier
    from hicache_helpers import ReadGate
    from test_cancel_hunt import PARAMS as SHORT, SECOND, make_engine, prefix_only_in_l3, reference

    eng = make_engine()
    await eng.start()
    want = await reference(SECOND)
    await prefix_only_in_l3(eng)
    gate = ReadGate(eng.cache.store)
    req = eng.add_request(SECOND, SHORT)
    await until(lambda: req in eng.parked, 30)
    loop = eng._loop_task
    stop = asyncio.ensure_future(eng.stop_loop())
    await until(loop.done, 30)  # (nothing runs: the loop ends with it parked)
    gate.release()
    await asyncio.wait_for(stop, 60)
    assert req in eng.parked and eng._loop_task is None
    await asyncio.wait_for(eng.shutdown(grace_s=60), 120)
    assert req.finish_reason != "abort" and req.output == want and eng.stats["aborted"] == 0
    assert req.result().cached_tokens[Tier.L3.name.lower()] > 0


@pytest.mark.asyncio
async def test_a_shutdowns_grace_waits_for_a_continuing_client_between_its_requests():
    """A client counted in `continuing` (a beam search between its steps, nothing of it queued) holds the grace
    open: its next request (continuing=True) is taken and runs to its end, and the shutdown ends once the client
    is done."""
    eng = _engine()
    await eng.start()
    eng.continuing += 1
    closing = asyncio.ensure_future(eng.shutdown(grace_s=60))
    await until(lambda: eng._closing, 30)
    step = eng.add_request([5] * 9, PARAMS, continuing=True)
    await until(lambda: step.state.done, 60)
    assert step.finish_reason == "length" and not closing.done()
    eng.continuing -= 1
    await asyncio.wait_for(closing, 60)
    assert eng.stats["aborted"] == 0


@pytest.mark.asyncio
async def test_a_stop_abort_that_came_as_the_request_ended_does_not_outlive_it():
    """abort(rid, stop=True) for a request whose step in flight makes its last token: it ends by length, and the
    stop is forgotten with it, so a later request reusing its id and aborted (no stop) ends "abort", not "stop"."""
    eng = _engine(overlap_schedule=False)
    req = eng.add_request([1] * 9, SamplingParams(max_tokens=2, ignore_eos=True), rid="x")
    collect, gate, held = eng.runner.collect, asyncio.Event(), asyncio.Event()

    async def held_collect(handle):
        if req.output and not gate.is_set():  # (its last step: held until the abort is in)
            held.set()
            await gate.wait()
        return await collect(handle)
    eng.runner.collect = held_collect
    await eng.start()
    await asyncio.wait_for(held.wait(), 30)
    assert await eng.abort("x", stop=True)
    gate.set()
    await until(lambda: req.state.done, 30)
    assert req.finish_reason == "length" and len(req.output) == 2
    again = eng.add_request([2] * 9, SamplingParams(max_tokens=40, ignore_eos=True), rid="x")
    await until(lambda: again.output, 30)
    assert await eng.abort("x")
    await until(lambda: again.state.done, 30)
    assert again.finish_reason == "abort" and eng.stats["aborted"] == 1
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_request_aborted_queued_after_its_restore_landed_reports_no_cached_tokens():
    """A request whose L2 restore landed goes back to the queue; where every running slot is taken it waits there,
    its hits planned but never served. Aborted then, its result's cached_tokens are all 0 (as for one aborted parked
    or queued before any plan), not the restore's hits its admission never took."""
    from test_mutation_loop_s64 import _hicache_engine, _prefix_in_l2_only

    eng = _hicache_engine(num_pages=512, max_running_requests=2, restore_overlap=False)
    prefix, gate = await _prefix_in_l2_only(eng)
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    busy = eng.add_request([50] * 9, long)
    await eng.start()
    await until(lambda: busy.output, 30)
    req = eng.add_request(prefix + [2], SamplingParams(max_tokens=4))
    await until(lambda: req in eng.parked and req.hit_tokens["l2"] > 0, 30)
    other = eng.add_request([60] * 9, long)  # (takes the second running slot)
    await until(lambda: other in eng.running, 30)
    gate.set()
    await until(lambda: req in eng.waiting, 30)
    assert await eng.abort(req.rid)
    await until(lambda: req.state.done, 30)
    assert req.result().cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
    await eng.shutdown()

"""Session 69's lifecycle leftovers: a request whose end could not be logged, and a loop task that
asyncio.run() cancelled.

- `Engine.finish` sets a request's ended state before it logs the end. When the log line raised, the
  loop crashed and `fail_live_requests` (which skips ended requests) never sent that request its last
  event: its client waited forever (a real bug, found by mutant T7 of scheduler/loop_task.py). Now
  its last event goes out whatever the log does, and the crash still surfaces at shutdown(); and a
  crash's `fail_live_requests` sends no second one when only logging a failure raised.
- `crash_of` takes a cancelled loop task for no crash (mutant T6): a second asyncio.run() serves
  after one that ended without shutdown(), instead of raising CancelledError from add_request."""
from __future__ import annotations

import asyncio

import pytest

from scheduler.request import SamplingParams
from test_lifecycle_hunt import assert_nothing_queued, make_engine

HANG_GUARD_S = 20  # a client with no last event by then would wait forever


async def _events(req) -> list:
    events = [await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)]
    while not events[-1].finished:
        events.append(await asyncio.wait_for(req.queue.get(), HANG_GUARD_S))
    return events


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["finished", "aborted"])
async def test_a_request_whose_end_cannot_be_logged_still_gets_its_last_event(end):
    eng = make_engine()
    await eng.start()
    params = SamplingParams(max_tokens=3 if end == "finished" else 400, ignore_eos=True)
    req = eng.add_request([1, 2, 3, 4, 5], params)
    log_event = eng.log_event

    def failing_log(r, state, **fields):
        if state == end:
            raise RuntimeError("injected: the log's file system is full")
        return log_event(r, state, **fields)
    eng.log_event = failing_log
    if end == "aborted":
        first = await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)
        assert not first.finished
        await eng.abort(req.rid)
    events = await _events(req)
    assert events[-1].finish_reason == ("length" if end == "finished" else "abort")
    assert events[-1].index == len(req.output)
    assert req.rid not in eng.requests
    eng.log_event = log_event
    with pytest.raises(RuntimeError, match="file system is full"):  # (the loop's crash is not lost)
        await eng.shutdown()
    assert_nothing_queued(eng)
    eng.check_integrity()


def test_a_request_queued_after_an_asyncio_run_that_ended_without_shutdown_is_served():
    eng = make_engine()
    prompt, params = [1, 2, 3, 4, 5], SamplingParams(max_tokens=3)

    async def first():
        return [ev.token_id async for ev in eng.submit(prompt, params)]

    async def second():
        req = eng.add_request(prompt, params)  # (regression guard: raised the cancelled loop task's CancelledError)
        await eng.start()
        return [ev.token_id for ev in await _events(req)]
    before = asyncio.run(first())
    assert eng._loop_task.cancelled()
    assert asyncio.run(second()) == before and len(before) == 4
    asyncio.run(eng.shutdown())
    assert_nothing_queued(eng)
    eng.check_integrity()


@pytest.mark.asyncio
async def test_a_crash_whose_failed_requests_cannot_be_logged_ends_each_once(monkeypatch):
    """The loop crashed, and logging each request's failure raises too: every live request still ends
    with one error event, counted failed once (regression: fail_live_requests, seeing `finish` raise after
    it had sent the last event, sent a second one). fail_live_requests ends them all in one go, so
    anything sent after a last event is queued by the time the last request's is read."""
    eng = make_engine()
    await eng.start()
    reqs = [eng.add_request([1 + i, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(3)]
    log_event = eng.log_event

    def broken():
        raise RuntimeError("injected scheduler bug")

    def failing_log(r, state, **fields):
        if state == "failed":
            raise RuntimeError("injected: the log's file system is full")
        return log_event(r, state, **fields)
    monkeypatch.setattr(eng.admission, "decode_batch", broken)
    monkeypatch.setattr(eng, "log_event", failing_log)
    for req in reqs:
        events = await _events(req)
        assert events[-1].finish_reason == "error" and "injected scheduler bug" in events[-1].error
    assert all(req.queue.empty() for req in reqs)
    assert eng.stats["failed"] == 3 and not eng.requests
    monkeypatch.setattr(eng, "log_event", log_event)
    with pytest.raises(RuntimeError, match="injected scheduler bug"):
        await eng.shutdown()
    eng.check_integrity()

"""Session 71's raise hunt over the Responses API and the engine's abort, second pass (after test_raise_api_s70.py):
a call at the end of a request's life raising. Pinned here:
- a background response whose final Response could not be kept (the store's `put` raising as the run ended) was
  still reported as it ended (GET: "incomplete" or "completed"), while the store held the response as it started:
  a follow-up naming it (previous_response_id) was served on a conversation without its answer, silently. Now the
  run ends "failed" (its last event `response.failed`, with the error), as a streamed response's failed keep ends
  its stream, and a follow-up is refused;
- `Engine.abort` of a parked request (in no batch: ended at once) whose end raised (freeing its pages) left it
  half-ended: out of the parked list yet PARKED, with no last event; once its read landed, the loop unparked it and
  crashed (`parked.remove`): every live request failed, and a server refused all requests from then on (503,
  "the engine loop failed"). Now it ends as `_settle_aborts` ends one whose end raised (failed, `end_broken`), and
  the error is raised (the server's `abort_quietly` logs it)."""
from __future__ import annotations

import asyncio
import json

import pytest

from hicache_helpers import ReadGate, until
from scheduler.request import RequestState
from test_cancel_hunt import OTHER, PARAMS, SECOND, make_engine, prefix_only_in_l3
from test_lifecycle_hunt import assert_nothing_queued
from test_raise_api_s70 import _last_event, _release_raises_for
from test_raise_http_s69 import RESPONSE, ASGICall, raise_once, serving

HANG_GUARD_S = 20  # a run or a request with no end by then would wait forever


def _answer(call: ASGICall) -> dict:
    return json.loads(b"".join(m.get("body", b"") for m in call.sent if m["type"] == "http.response.body"))


@pytest.mark.asyncio
async def test_a_background_response_whose_final_keep_raises_ends_failed(monkeypatch):
    """The run's final Response (its 64 tokens: "incomplete") raised as it was kept (the store's second `put`: the
    first keeps the queued one). It was still reported "incomplete", and a follow-up naming it got a prompt without
    its answer; now it is "failed", with the error, and a follow-up is a 400 naming previous_response_id."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, st.responses, "put", skip=1)
        call = ASGICall(app, "/v1/responses", {**RESPONSE, "background": True})
        assert await call.answer() == 200
        response_id = _answer(call)["id"]
        [run] = st.background.running
        await asyncio.wait_for(asyncio.wait([run.task]), HANG_GUARD_S)
        assert run.finished and st.in_flight == 0
        got = st.responses.response(response_id)  # (GET /v1/responses/{id})
        assert got["status"] == "failed", f"the Response was not kept, yet GET says {got['status']!r}"
        assert "injected" in got["error"]["message"]
        assert run.events[-1]["type"] == "response.failed" and run.events[-1]["response"] is got
        numbers = [e["sequence_number"] for e in run.events]
        assert numbers == list(range(len(numbers)))
        follow_up = ASGICall(app, "/v1/responses", {**RESPONSE, "previous_response_id": response_id})
        assert await follow_up.answer() == 400, "a follow-up was served without the answer it follows"
        assert _answer(follow_up)["error"]["param"] == "previous_response_id"


@pytest.mark.asyncio
async def test_a_background_response_that_cannot_be_kept_at_all_still_ends_failed(monkeypatch):
    """Every keep after the first raises, its failed Response's too: the run still ends, recorded "failed" (GET
    reads the run's Response), its followers see its end, and nothing is left running or raised unread."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        real, calls = st.responses.put, []

        def put(*args, **kw):
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("injected: put raised")
            return real(*args, **kw)
        monkeypatch.setattr(st.responses, "put", put)
        call = ASGICall(app, "/v1/responses", {**RESPONSE, "background": True})
        assert await call.answer() == 200
        [run] = st.background.running
        await asyncio.wait_for(asyncio.wait([run.task]), HANG_GUARD_S)
        assert run.task.exception() is None and len(calls) == 3
        assert run.finished and not st.background.running and st.in_flight == 0
        assert st.responses.response(run.id)["status"] == "failed"
        assert [e["type"] async for e in run.follow()][-1] == "response.failed"


@pytest.mark.asyncio
async def test_an_abort_of_a_parked_request_whose_end_raises_still_ends_it():
    """--disable-hicache-prefetch: the loop waits for SECOND's L3 read, SECOND parked. Its abort ends it at once, and
    that end raises (freeing its pages). It was left out of the parked list, with no last event, and once its read
    landed the loop crashed unparking it. Now it ends failed, the error is raised, and the same loop serves on."""
    eng = make_engine(prefetch=False)
    await eng.start()
    await prefix_only_in_l3(eng)
    gate = ReadGate(eng.cache.store)
    req = eng.add_request(SECOND, PARAMS)
    await until(lambda: req.state is RequestState.PARKED, HANG_GUARD_S)
    with pytest.MonkeyPatch.context() as patch:
        _release_raises_for(patch, eng, req)
        with pytest.raises(RuntimeError, match="injected"):
            await eng.abort(req.rid)
        gate.release()
        assert await _last_event(req) == "error", "the aborted request never ended"
    assert req.output == [] and req.state is RequestState.FAILED, "the aborted request was generated"
    loop = eng._loop_task
    [out] = await asyncio.wait_for(eng.generate_async([OTHER], PARAMS), HANG_GUARD_S)
    assert out.finish_reason == "length"
    assert eng._loop_task is loop, "the engine loop crashed (unparking the half-ended request): a new one served"
    assert_nothing_queued(eng)
    await asyncio.wait_for(eng.shutdown(), HANG_GUARD_S)

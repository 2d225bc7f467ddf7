"""Session 70's raise hunt over the API layer: a call of the server's stream rendering raising mid-stream (a bug in
a chunk's building, in a choice's reading, in the Responses API's events or in keeping the finished Response) and
the engine's abort bookkeeping raising while several requests end. Pinned here:
- a stream's chunk-building raising (`Choices._chunk`, a beam search's step, `sse_block`, the store's `put` as a
  streamed Response finishes) raised out of the ASGI app after its 200 and some chunks: the client's connection
  was cut mid-body (no error event, no `data: [DONE]`, no `response.failed`; with a beam search an empty 200). Now
  the stream ends with an error event naming the bug, then its normal end, and its requests and places are freed;
  the stream's clean-up raising after its `data: [DONE]` cut the body the same way: now only logged;
- `Engine._settle_aborts` ended the aborted requests in turn and stopped at the first whose `finish` raised: with
  no loop running (after stop_loop(): `abort`, `shutdown`) that request and the ones after it never got their last
  event, and their clients waited forever, after shutdown() too. Now each one ends (the one whose end raised
  failed, as `fail_live_requests` fails one), then the first error is raised."""
from __future__ import annotations

import asyncio
import json

import pytest

import scheduler.choices as choices
import scheduler.responses_output as responses_output
from scheduler.request import SamplingParams
from test_lifecycle_hunt import assert_nothing_queued, make_engine
from test_raise_http_s69 import RESPONSE, ASGICall, a_later_request_is_served, ends, raise_once, serving

HANG_GUARD_S = 20  # a client with no last event by then would wait forever

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "ignore_eos": True}
COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 16, "ignore_eos": True}
STREAMS = {  # (where, name, skip: the call that raises, path, body, how its engine requests end: None, a search's)
    "completion_chunk": (lambda st, eng: choices.Choices, "_chunk", 1, "/v1/completions", {**COMPLETION, "n": 2},
                         "abort"),
    "chat_chunk": (lambda st, eng: choices.Choices, "_chunk", 1, "/v1/chat/completions", CHAT, "abort"),
    "beam_search_step": (lambda st, eng: eng, "add_request", 2, "/v1/completions",
                         {"model": "tiny", "prompt": "hello", "max_tokens": 4, "use_beam_search": True, "n": 2}, None),
    "responses_chunk": (lambda st, eng: choices.Choices, "_chunk", 1, "/v1/responses", RESPONSE, "abort"),
    "responses_sse_block": (lambda st, eng: responses_output, "sse_block", 3, "/v1/responses", RESPONSE, "abort"),
    # (keeping the finished Response: its request ended at its max_output_tokens)
    "responses_store_put": (lambda st, eng: st.responses, "put", 0, "/v1/responses", RESPONSE, "length"),
}


def sse_events(call: ASGICall) -> list[tuple[str | None, str]]:
    """The stream's (event name or None, data) in order, off the body messages the app sent."""
    text = b"".join(m.get("body", b"") for m in call.sent if m["type"] == "http.response.body").decode()
    out = []
    for block in filter(None, text.split("\n\n")):
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((fields.get("event"), fields["data"]))
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("point", sorted(STREAMS))
async def test_a_raise_mid_stream_ends_the_stream_with_an_error_event(monkeypatch, point):
    """The raise came after the 200 and the first chunks: the app raised it and the client's connection was cut
    mid-body. Now an error event naming it, then the stream's end: `data: [DONE]` (a chat's, a completion's) or
    `response.failed` (the Responses API's), and the body closed; the requests aborted, the places freed."""
    where, name, skip, path, body, ended = STREAMS[point]
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, where(st, eng), name, skip=skip)
        call = ASGICall(app, path, {**body, "stream": True})
        assert await call.answer() == 200
        assert call.task.done() and call.task.exception() is None, "the app raised: the connection was cut"
        assert call.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        events = sse_events(call)
        if path == "/v1/responses":
            [error] = [json.loads(data) for name, data in events if name == "error"]
            assert "injected" in error["message"]
            last_name, last = events[-1]
            assert last_name == "response.failed" and json.loads(last)["response"]["status"] == "failed"
            numbers = [json.loads(data)["sequence_number"] for _, data in events]
            assert numbers == sorted(set(numbers)), "the events' sequence numbers do not go on"
        else:
            assert [data for _, data in events[-2:]][1] == "[DONE]"
            error = json.loads(events[-2][1])["error"]
            assert error["code"] == "internal_error" and "injected" in error["message"]
        assert st.in_flight == 0, f"{st.in_flight} places of --max-concurrent-requests leaked"
        if ended is not None:
            assert [await ends(req) for req in queued] == [ended] * len(queued)
        assert not eng.requests and eng.continuing == 0
        await a_later_request_is_served(app)


async def _last_event(req):
    """Its final event's finish reason, or None where none came within the hang guard."""
    try:
        while not (ev := await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)).finished:
            pass
    except asyncio.TimeoutError:
        return None
    return ev.finish_reason


def _release_raises_for(monkeypatch, eng, victim) -> None:
    """Ending `victim` raises in `admission.release` (every time: its end is broken for good)."""
    real = eng.admission.release

    def release(req, *args, **kw):
        if req is victim:
            raise RuntimeError("injected: release raised")
        return real(req, *args, **kw)
    monkeypatch.setattr(eng.admission, "release", release)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["abort", "shutdown"])
async def test_an_end_that_raises_while_aborts_settle_leaves_no_client_waiting(monkeypatch, how):
    """Three requests queued on a stopped loop, then aborted (one abort each) or shut down (all at once); ending
    the middle one raises every time. `_settle_aborts` stopped at it: it and the ones after it (in the set's order)
    never got their last event, and their clients waited forever, even once shutdown() had returned."""
    eng = make_engine()
    await eng.start()
    reqs = [eng.add_request([1 + i, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(3)]
    await eng.stop_loop()
    _release_raises_for(monkeypatch, eng, reqs[1])
    if how == "shutdown":
        with pytest.raises(RuntimeError, match="injected"):
            await eng.shutdown()
    for req in reqs if how == "abort" else ():
        if req is reqs[1]:
            with pytest.raises(RuntimeError, match="injected"):
                await eng.abort(req.rid)
        else:
            await eng.abort(req.rid)
    assert [await _last_event(req) for req in reqs] == ["abort", "error", "abort"]
    assert_nothing_queued(eng)
    assert not eng.aborting
    monkeypatch.undo()
    if how == "abort":
        await asyncio.wait_for(eng.shutdown(), HANG_GUARD_S)


@pytest.mark.asyncio
async def test_a_clean_up_that_raises_after_the_streams_end_leaves_the_stream_whole(monkeypatch):
    """Every choice ended and `data: [DONE]` was sent; the stream's clean-up (`Choices.close`) then raised out of the
    app: the body was never closed, and a client reading to the body's end (the openai SDK does, after [DONE]) got a
    broken connection. Now the error is logged and the stream ends as it was."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, choices.Choices, "close")
        call = ASGICall(app, "/v1/completions", {**COMPLETION, "stream": True})
        assert await call.answer() == 200
        assert call.task.done() and call.task.exception() is None, "the app raised: the connection was cut"
        assert call.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        events = [data for _, data in sse_events(call)]
        assert events[-1] == "[DONE]" and not any("error" in json.loads(data) for data in events[:-1])
        assert st.in_flight == 0 and [await ends(req) for req in queued] == ["length"]
        await a_later_request_is_served(app)

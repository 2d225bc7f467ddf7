"""Session 70's raise hunt at decode time: a per-token call of the server raising while a stream runs (the text's
incremental decoding, a stop string's matcher, the logprobs' shaping, the tool-call parser of a chat with tools)
must end that stream as the server ends a stream whose request failed: an OpenAI error event, then `data: [DONE]`
(scheduler/choices.py), and for the Responses API an `error` event and `response.failed`. Its places of
--max-concurrent-requests come back, its engine requests are aborted and the server serves on.

Regression: the raise went out of `Choices.sse` mid-stream, the response had started (200), so the connection was
cut with no last chunk (a client read "peer closed connection without sending complete message body") where a
whole response's same raise answered a 500 JSON error (pinned by tests/test_mutation_api_s60.py).

(The engine side of the hunt, the loop's per-step calls raising: a guide's accept / masks / drafts, penalties,
logprobs, speculative proposing and verifying, all crash the loop, and every live request gets its error event,
the tiers stay whole, a new request is refused until start() runs a new loop, which then serves: the behaviour
test_raise_hunt_s69 and test_server_crash_hunt pin; nothing new to pin there.)"""
from __future__ import annotations

import dataclasses
import json

import pytest

import scheduler.logprobs as logprobs
import scheduler.stop_strings as stop_strings
import scheduler.tool_calls as tool_calls
from scheduler.prom import OUTCOMES
from scheduler.tokenizer import IncrementalDecoder
from test_raise_http_s69 import ASGICall, a_later_request_is_served, ends, raise_once, serving

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 24, "ignore_eos": True, "stream": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "ignore_eos": True,
        "stream": True}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
# a call the server makes for each token it streams, and a request whose stream makes it (after a few tokens)
PER_TOKEN = {
    "incremental_decode": (IncrementalDecoder, "feed", "/v1/completions", COMPLETION),
    "incremental_decode_n2": (IncrementalDecoder, "feed", "/v1/completions", {**COMPLETION, "n": 2}),
    "stop_string_match": (stop_strings.StopMatcher, "feed", "/v1/completions", {**COMPLETION, "stop": ["zzz"]}),
    "logprobs_entry": (logprobs.LogprobsShaper, "entry", "/v1/completions", {**COMPLETION, "logprobs": 2}),
    "tool_call_parse": (tool_calls.HermesToolParser, "feed", "/v1/chat/completions", {**CHAT, "tools": TOOLS}),
}


def sse_data(call: ASGICall) -> list[str]:
    """The stream's `data:` payloads, in order."""
    text = b"".join(m.get("body", b"") for m in call.sent if m["type"] == "http.response.body").decode()
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def outcomes(st) -> dict[str, int]:
    """The server's requests counted by outcome so far (hicache_requests_total's nonzero labels)."""
    counts = {o: int(st.metrics.requests.labels(o)._value.get()) for o in OUTCOMES}
    return {o: n for o, n in counts.items() if n}


def ended(call: ASGICall) -> bool:
    """The response's last body message was sent: the stream ended, rather than being cut."""
    bodies = [m for m in call.sent if m["type"] == "http.response.body"]
    return bool(bodies) and not bodies[-1].get("more_body", False)


@pytest.mark.asyncio
@pytest.mark.parametrize("point", sorted(PER_TOKEN))
async def test_a_per_token_raise_ends_the_stream_with_an_error_event_and_done(monkeypatch, point):
    owner, name, path, body = PER_TOKEN[point]
    async with serving(monkeypatch) as (app, st, eng, queued):
        monkeypatch.setattr(st, "limits", dataclasses.replace(st.limits, tool_call_parser="hermes"))
        raise_once(monkeypatch, owner, name, skip=3)
        call = ASGICall(app, path, body)
        assert await call.answer() == 200
        assert ended(call), "the stream was cut: no last chunk"
        data = sse_data(call)
        assert data[-1] == "[DONE]", data[-3:]
        error = json.loads(data[-2])["error"]
        assert error["code"] == "internal_error" and f"injected: {name} raised" in error["message"], error
        assert st.in_flight == 0, f"{st.in_flight} places of --max-concurrent-requests leaked"
        assert queued and [await ends(req) for req in queued] == ["abort"] * len(queued)
        assert outcomes(st) == {"failed": len(queued)}  # (the server's raise, not a client's abort)
        await a_later_request_is_served(app)


@pytest.mark.asyncio
async def test_a_per_token_raise_in_a_whole_response_counts_its_choices_failed(monkeypatch):
    """The same raise in a whole response answers a 500 (tests/test_mutation_api_s60.py); its choices count as failed
    in the server's metrics (regression: as aborted, a client's going away)."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, IncrementalDecoder, "feed", skip=3)
        call = ASGICall(app, "/v1/completions", {**COMPLETION, "stream": False, "n": 2})
        assert await call.answer() == 500
        assert [await ends(req) for req in queued] == ["abort"] * 2
        assert st.in_flight == 0 and outcomes(st) == {"failed": 2}
        await a_later_request_is_served(app)


@pytest.mark.asyncio
async def test_a_per_token_raise_fails_a_responses_stream_with_its_error_events(monkeypatch):
    """The Responses API streams a chat's chunks as its own events: the same raise ends it with an `error` event and
    `response.failed` (regression: the connection was cut there too)."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, IncrementalDecoder, "feed", skip=3)
        call = ASGICall(app, "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 24,
                                               "stream": True})
        assert await call.answer() == 200
        assert ended(call), "the stream was cut: no last event"
        events = [json.loads(d) for d in sse_data(call)]
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"], events[-2:]
        assert "injected: feed raised" in events[-1]["response"]["error"]["message"]
        assert st.in_flight == 0 and outcomes(st) == {"failed": 1}
        assert [await ends(req) for req in queued] == ["abort"]
        await a_later_request_is_served(app)

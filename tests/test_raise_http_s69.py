"""Session 69's raise hunt, one layer up: a call inside the HTTP server raising (a bug in a response's rendering set-up,
the Prometheus client, a metric's bookkeeping) must still free the request's --max-concurrent-requests places, abort its
engine requests and let shutdown end. The server is driven in-process through its ASGI app (its own lifespan, the real
engine on the tiny preset, CPU). Pinned here:
- `_generate` after admission (a choice's `Generation(...)` just after its engine request was queued, the
  prompt-tokens counter, `Choices(...)`, the Responses API's `shape.output`, a background response's start, the
  stream's response) was outside every guard: a raise there answered 500 but left
  the slots held for good (the server 429s once --max-concurrent-requests of them leaked) and the engine requests
  generating to their end with nobody reading them;
- `_Slot.add` counted the place before the in-flight gauge's `inc`: that raising leaked the place;
- a stream's clean-up (`Choices.close` -> `Generation.close`) raising skipped the other choices' aborts and the
  stream's `slot.release()`;
- a background response's run whose clean-up raised never released its slot, never ended (its followers waited
  forever) and stayed in `BackgroundResponses.running`: shutdown's `close()` then looped for ever."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import pytest

import scheduler.responses_output as responses_output
import scheduler.server as server
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer
from test_server_crash_hunt import post_scope

HANG_GUARD_S = 20  # a request or shutdown with no end by then would wait forever
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


class ASGICall:
    """One HTTP request to the app, run as a task; `send_fails_after`: the client is gone after that many body
    messages (each later send raises OSError, as a write to a closed socket does)."""

    def __init__(self, app, path: str, body: dict, send_fails_after: int | None = None) -> None:
        self.body = json.dumps(body).encode()
        self.sent: list[dict] = []
        self.fails_after, self._body_read = send_fails_after, False
        self.task = asyncio.ensure_future(app(post_scope(path, self.body), self._receive, self._send))

    async def _receive(self) -> dict:
        if not self._body_read:
            self._body_read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await asyncio.Event().wait()  # (no disconnect message: only the failing send tells the server)

    async def _send(self, message: dict) -> None:
        if message["type"] == "http.response.body" and self.fails_after is not None:
            if sum(m["type"] == "http.response.body" for m in self.sent) >= self.fails_after:
                raise OSError("injected: the client went away")
        self.sent.append(message)

    async def answer(self) -> int | None:
        """The response's status (None: none was sent); an error the app re-raised (after its 500) is swallowed."""
        try:
            await asyncio.wait_for(asyncio.shield(self.task), HANG_GUARD_S)
        except (RuntimeError, OSError):
            pass
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None


def raise_once(monkeypatch, obj, name: str, skip: int = 0) -> None:
    """obj.name raises RuntimeError once, on its call after `skip` calls; every other call is the real one."""
    real, calls = getattr(obj, name), []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == skip + 1:
            raise RuntimeError(f"injected: {name} raised")
        return real(*args, **kw)
    monkeypatch.setattr(obj, name, failing)


@asynccontextmanager
async def serving(monkeypatch):
    """(app, its _ServerState, engine, the engine requests the server queued), the lifespan's exit (shutdown)
    under the hang guard."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=128, max_new_tokens_limit=64))
    tok = ByteTokenizer(eng.vocab_size)
    tok.use_chat_template(TEMPLATE)
    app = create_app(eng, ServerLimits(shutdown_grace_s=0.0, max_concurrent_requests=4), tokenizer=tok)
    queued, add = [], eng.add_request

    def recording_add(*args, **kw):
        queued.append(add(*args, **kw))
        return queued[-1]
    monkeypatch.setattr(eng, "add_request", recording_add)
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    try:
        yield app, app.state.hc, eng, queued
    finally:
        await asyncio.wait_for(lifespan.__aexit__(None, None, None), HANG_GUARD_S)
    eng.check_integrity()


async def ends(req) -> str:
    """An engine request's finish reason, read off its queue (nobody else reads it)."""
    while not req.state.done or not req.queue.empty():
        ev = await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)
        if ev.finished:
            return ev.finish_reason
    return req.finish_reason


async def a_later_request_is_served(app) -> None:
    call = ASGICall(app, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
    assert await call.answer() == 200


RESPONSE = {"model": "tiny", "input": "hi", "max_output_tokens": 64}
AFTER_ADMISSION = {  # a call _generate makes once the engine requests are queued, before the response takes them
    "prompt_tokens_counter": (lambda st: st.metrics.prompt_tokens, "inc", "/v1/completions", {"stream": True}),
    "choices": (lambda st: server, "Choices", "/v1/completions", {}),
    "generation": (lambda st: server, "Generation", "/v1/completions", {}),  # (its engine request just queued)
    "responses_output": (lambda st: server.ResponsesShape, "output", "/v1/responses", None),
    "background_start": (lambda st: st.background, "start", "/v1/responses", {"background": True}),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("point", sorted(AFTER_ADMISSION))
async def test_a_raise_after_admission_frees_the_slots_and_aborts_the_engine_requests(monkeypatch, point):
    """A raise between the engine requests' queuing and the response taking them over answered 500 but kept the
    request's places of --max-concurrent-requests for good, and its engine requests ran to their end unread."""
    where, name, path, extra = AFTER_ADMISSION[point]
    body = {**RESPONSE, **(extra or {})} if path == "/v1/responses" else \
        {"model": "tiny", "prompt": "hello", "max_tokens": 64, "ignore_eos": True, "n": 2, "echo": True, **extra}
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, where(st), name)
        assert await ASGICall(app, path, body).answer() == 500
        assert st.in_flight == 0, f"{st.in_flight} places of --max-concurrent-requests leaked"
        assert queued and [await ends(req) for req in queued] == ["abort"] * len(queued)
        assert not st.background.running
        await a_later_request_is_served(app)


@pytest.mark.asyncio
async def test_the_in_flight_gauge_raising_holds_no_place(monkeypatch):
    """_Slot counted its place, then the gauge's inc raised: the place was never released (no slot to release)."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, st.metrics.in_flight, "inc")
        assert await ASGICall(app, "/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}).answer() \
            == 500
        assert st.in_flight == 0 and not queued
        await a_later_request_is_served(app)


@pytest.mark.asyncio
async def test_a_stream_whose_clean_up_raises_still_aborts_every_choice_and_frees_its_places(monkeypatch):
    """The client of an n=2 stream goes away (its send raises); closing choice 0 raises in the metrics: choice 1
    was never aborted (it generated its 64 tokens unread) and SSEResponse never released the stream's places."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, st.metrics, "ended")
        call = ASGICall(app, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 64, "n": 2,
                                                 "ignore_eos": True, "stream": True}, send_fails_after=1)
        assert await call.answer() == 200
        assert st.in_flight == 0, f"{st.in_flight} places of --max-concurrent-requests leaked"
        assert [await ends(req) for req in queued] == ["abort", "abort"]
        await a_later_request_is_served(app)


@pytest.mark.asyncio
async def test_a_background_run_whose_clean_up_raises_ends_and_lets_shutdown_end(monkeypatch):
    """A background response's run whose clean-up raised (here its output's close) kept its slot, was never marked
    finished (a GET ?stream=true follower waited forever) and stayed running: shutdown's close() looped for ever."""
    async with serving(monkeypatch) as (app, st, eng, queued):
        raise_once(monkeypatch, responses_output.ResponseOutput, "close")
        assert await ASGICall(app, "/v1/responses", {**RESPONSE, "background": True}).answer() == 200
        [run] = st.background.running
        await asyncio.wait_for(asyncio.wait([run.task]), HANG_GUARD_S)
        assert run.finished and not st.background.running, "the run never ended"
        assert st.in_flight == 0, "the run's place of --max-concurrent-requests leaked"
        follower = run.follow()
        assert [e["type"] async for e in follower][-1] == "response.incomplete"  # (its 64 tokens: max_output_tokens)
        await a_later_request_is_served(app)

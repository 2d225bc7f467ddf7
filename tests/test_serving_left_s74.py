"""Serving-layer leftovers of session 74, each pinned where it went wrong:

* a background response's cancel (scheduler/responses_background.py): a cancel whose caller was cancelled while it
  waited for the run's first step flagged the run as cancelling without cancelling it, and every later cancel (POST
  .../cancel, DELETE, the shutdown's) then only waited for the run's natural end, reported "completed";
* a prompt's choices' tally (scheduler/prom.py PromptChoices): a request refused after some of its choices were
  queued never ended them, so the tally's open count stayed above 0 and ServerMetrics kept the request's body;
* GET /health after the engine's loop was stopped under the app (Engine.stop_loop): it said ok, and a request
  waited queued with nothing to run it;
* the 500 of a non-streamed request whose engine request failed: its body named no id to find it by in the logs.
A server through starlette's TestClient (the tiny preset, a one-line chat template); the background run on fakes.
"""
from __future__ import annotations

import asyncio
import gc
import weakref
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, TokenEvent
from scheduler.responses_background import BackgroundRun
from scheduler.server import ServerLimits, create_app

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
WAIT_S = 5.0  # (a bound on every wait; each is met in milliseconds)


@pytest.fixture(scope="module")
def client():
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    app = create_app(engine, ServerLimits(shutdown_grace_s=0.5, max_concurrent_requests=4, chat_template=TEMPLATE))
    with TestClient(app, raise_server_exceptions=False) as c:
        c.hc = app.state.hc
        yield c


# -- a background response's cancel ------------------------------------------------------------------------
class _Output:
    """A ResponseOutput that says it is in progress, then waits for `gate` before it completes."""
    id = "resp_s74"

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    def keep(self, response: dict, run) -> None:
        pass

    def response(self, status: str, output: list, usage=None, error=None) -> dict:
        return {"id": self.id, "status": status, "output": list(output), "error": error}

    async def events(self):
        yield {"type": "response.in_progress", "response": self.response("in_progress", [])}
        await self.gate.wait()
        yield {"type": "response.completed", "response": self.response("completed", [])}

    async def close(self) -> None:
        pass

    def cut_short(self, status: str, error=None) -> list[dict]:
        return [{"type": f"response.{status}", "response": self.response(status, [], error=error)}]


def _run(out: _Output, released: list) -> BackgroundRun:
    slot, store = SimpleNamespace(release=lambda: released.append(1)), SimpleNamespace(holds=lambda run: True)
    return BackgroundRun(out, slot, store)


def test_a_cancel_whose_caller_was_cancelled_before_the_runs_first_step_loses_no_later_cancel():
    """Regression: cancel() flagged the run before it waited for the task's first step; its caller cancelled there
    left the flag set and the task running, and the next cancel only waited for the run's end."""
    async def go():
        out, released = _Output(), []
        run = _run(out, released)
        first = run.cancel()
        assert first.send(None) is None  # (in its wait: the run's task has not taken its first step)
        first.close()  # (its caller cancelled there)
        second = asyncio.ensure_future(run.cancel())
        done, _ = await asyncio.wait([second], timeout=WAIT_S)
        out.gate.set()  # (the run ends either way)
        await asyncio.wait_for(asyncio.gather(run.task, second), WAIT_S)
        assert done, "the second cancel only waited for the run's end"
        assert run.response["status"] == "cancelled" and run.finished and released == [1]
        assert [e["type"] for e in run.events] == ["response.in_progress", "response.cancelled"]
    asyncio.run(go())


def test_cancels_of_a_background_response_apply_once_and_a_finished_one_is_returned_unchanged():
    """Two cancels at once: one cancellation, one `response.cancelled`, both answered with it; a cancel of a
    completed response returns it as it is (OpenAI's background mode)."""
    async def go():
        out, released = _Output(), []
        run = _run(out, released)
        await asyncio.sleep(0)  # (its first step)
        await asyncio.wait_for(asyncio.gather(run.cancel(), run.cancel()), WAIT_S)
        assert [e["type"] for e in run.events] == ["response.in_progress", "response.cancelled"] and released == [1]
        done_out, done_released = _Output(), []
        done_out.gate.set()
        finished = _run(done_out, done_released)
        await asyncio.wait_for(finished.task, WAIT_S)
        await asyncio.wait_for(finished.cancel(), WAIT_S)
        assert finished.response["status"] == "completed" and done_released == [1]
        assert [e["type"] for e in finished.events] == ["response.in_progress", "response.completed"]
    asyncio.run(go())


# -- a prompt's choices' tally -----------------------------------------------------------------------------
def test_a_request_refused_after_some_choices_were_queued_leaves_no_tally_holding_its_body(client, monkeypatch):
    """Regression: n=3, the engine refusing the third choice (the first two queued, then aborted): the prompt's
    tally counted two choices open for good and ServerMetrics held the request's body until the next request."""
    metrics, engine = client.hc.metrics, client.hc.engine
    bodies, real_choice, real_add = [], metrics.prompt_choice, engine.add_request

    def prompt_choice(api_req, index, choice):
        bodies.append(weakref.ref(api_req))
        return real_choice(api_req, index, choice)

    def add_request(prompt, params=None, rid=None, continuing=False):
        if rid.endswith("-2"):
            raise RequestError(f"duplicate request id {rid!r}")
        return real_add(prompt, params, rid, continuing)
    monkeypatch.setattr(metrics, "prompt_choice", prompt_choice)
    monkeypatch.setattr(engine, "add_request", add_request)
    r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "n": 3, "max_tokens": 2})
    assert r.status_code == 400 and "duplicate request id" in r.json()["error"]["message"], r.text
    assert len(bodies) == 2
    assert metrics._prompt.open == 0
    gc.collect()
    assert bodies[0]() is None, "the refused request's body is still held"


# -- /health once the loop is stopped ---------------------------------------------------------------------
def test_health_fails_and_a_request_is_refused_while_the_engine_loop_is_stopped(client):
    """Regression: after stop_loop() under the app, /health said ok and a completion waited queued with no loop
    to run it (a load balancer kept sending traffic); start() serves again."""
    engine = client.hc.engine
    client.portal.call(engine.stop_loop)
    try:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down", health.text
        r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 503 and "stop_loop" in r.json()["error"]["message"], r.text
        assert not engine.waiting
    finally:
        client.portal.call(engine.start)
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200


# -- the id in an engine failure's 500 ----------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
])
def test_an_engine_failures_500_names_the_request_as_the_logs_do(client, monkeypatch, path, body):
    """Regression: a non-streamed request whose engine request failed got a 500 naming no id (X-Request-Id only
    with --enable-request-id-headers): the operator could not find it in the logs, which name it by its rid."""
    engine, rids = client.hc.engine, []
    real_add = engine.add_request

    def failing(prompt, params=None, rid=None, continuing=False):  # (its first event: the engine failed it)
        req = real_add(prompt, params, rid, continuing)
        req.queue.put_nowait(TokenEvent(req.rid, None, 0, finished=True, finish_reason="error", error="boom"))
        rids.append(req.rid)
        return req
    monkeypatch.setattr(engine, "add_request", failing)
    r = client.post(path, json={"model": "tiny", **body})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "engine_error" and "boom" in error["message"], error
    [rid] = rids
    assert rid in error["message"], error

"""An engine loop that crashes under the HTTP server, and shutdown's grace on a stopped engine.

The server is driven in-process through its ASGI app (its own lifespan, the real engine on the
tiny preset, CPU) so that a request's body can be made to arrive in the very loop turn the engine
loop crashes in: the turn before the loop task's done-callbacks run."""
from __future__ import annotations

import asyncio
import json

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer

PAGE = 4
HANG_GUARD_S = 20  # a request that has no answer by then waits forever (nothing else would end it)


def make_engine(**kw) -> Engine:
    kw.setdefault("num_pages", 128)
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE, max_new_tokens_limit=64, **kw))


def post_scope(path: str, body: bytes) -> dict:
    """The ASGI scope of a JSON POST of `body` to `path` (spec 2.3)."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


class ASGICall:
    """One HTTP request to the app, run as a task: its body is sent when `send_body()` is called."""

    def __init__(self, app, path: str, body: dict) -> None:
        self.body = json.dumps(body).encode()
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.sent: list[dict] = []
        self.reading = asyncio.Event()  # the app asked for the body
        self.task = asyncio.ensure_future(app(post_scope(path, self.body), self._receive, self._send))

    async def _receive(self) -> dict:
        self.reading.set()
        return await self.inbox.get()  # after the body: nothing more (the client stays connected)

    async def _send(self, message: dict) -> None:
        self.sent.append(message)

    def send_body(self) -> None:
        self.inbox.put_nowait({"type": "http.request", "body": self.body, "more_body": False})

    async def answer(self) -> tuple[int, bytes]:
        await asyncio.wait_for(asyncio.shield(self.task), HANG_GUARD_S)
        start = next(m for m in self.sent if m["type"] == "http.response.start")
        return start["status"], b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def error_of(body: bytes, stream: bool) -> dict:
    if stream:  # the error event of an SSE stream
        events = [json.loads(line[6:]) for line in body.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return events[-1]["error"]
    return json.loads(body)["error"]


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_whose_body_arrives_as_the_loop_crashes_gets_a_503_not_a_hang(monkeypatch, stream):
    """The flag that refuses new requests after a loop crash was set by the loop task's done-callback,
    which runs a loop turn after the crash: a request admitted in that turn was queued into the dead
    engine and its client waited forever (regression). Now it gets a 503 (engine_failed); the request
    that was running when the loop crashed gets a 500 (engine_error)."""
    eng = make_engine()
    app = create_app(eng, ServerLimits(shutdown_grace_s=0.0), tokenizer=ByteTokenizer(eng.vocab_size))
    async with app.router.lifespan_context(app):
        late = ASGICall(app, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                                                 "stream": stream})
        await asyncio.wait_for(late.reading.wait(), HANG_GUARD_S)  # admitted once, waiting for its body

        def broken():  # the loop's first decode plan: the late request's body lands in this same turn
            late.send_body()
            raise RuntimeError("injected scheduler bug")
        monkeypatch.setattr(eng.admission, "decode_batch", broken)
        running = ASGICall(app, "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4})
        running.send_body()

        status, body = await running.answer()
        assert status == 500 and error_of(body, False)["code"] == "engine_error", body
        status, body = await late.answer()
        if stream and status == 200:  # (a stream may only have its error as its last event)
            err = error_of(body, True)
        else:
            assert status == 503, body
            err = error_of(body, False)
        assert err["code"] == "engine_failed" and "injected scheduler bug" in err["message"], body
        assert not eng.requests and not eng.waiting, "a request is still queued in the dead engine"


@pytest.mark.asyncio
async def test_add_request_refuses_a_crashed_loop_and_start_restarts_it(monkeypatch):
    """add_request (without start) on an engine whose loop died queued the request where nothing would
    ever run it (regression: its queue never got an event). It refuses, naming the crash; start()
    (as submit() does) runs a new loop, which serves."""
    eng = make_engine()
    await eng.start()
    real = eng.admission.decode_batch

    def broken():
        raise RuntimeError("injected scheduler bug")
    monkeypatch.setattr(eng.admission, "decode_batch", broken)
    first = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    ev = await asyncio.wait_for(first.queue.get(), HANG_GUARD_S)
    while not ev.finished:
        ev = await asyncio.wait_for(first.queue.get(), HANG_GUARD_S)
    assert ev.finish_reason == "error" and "injected" in ev.error
    await asyncio.sleep(0)  # the loop task has ended
    assert eng._loop_task.done()
    with pytest.raises(RequestError, match="crashed.*injected scheduler bug"):
        eng.add_request([4, 5, 6], SamplingParams(max_tokens=3))
    assert not eng.requests and not eng.waiting
    monkeypatch.setattr(eng.admission, "decode_batch", real)
    events = [ev async for ev in eng.submit([4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))]
    assert events[-1].finish_reason == "length" and events[-1].error is None
    await eng.shutdown()


@pytest.mark.asyncio
async def test_every_live_request_gets_its_error_even_when_failing_one_raises_again(monkeypatch):
    """The state a crash leaves may be what crashed it: failing the live requests can raise too (here:
    releasing a request's pages). Each live request still gets its final error event (regression: the
    first such failure ended the loop's clean-up and every later client waited forever)."""
    eng = make_engine()
    await eng.start()
    reqs = [eng.add_request([1 + i, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(3)]

    def broken():
        raise RuntimeError("injected scheduler bug")

    def broken_release(req, publish):
        raise AssertionError("injected bookkeeping corruption")
    monkeypatch.setattr(eng.admission, "decode_batch", broken)
    monkeypatch.setattr(eng.admission, "release", broken_release)
    for req in reqs:
        ev = await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)
        while not ev.finished:
            ev = await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)
        assert ev.finish_reason == "error" and "injected scheduler bug" in ev.error, ev
        assert req.state.done
    assert not eng.requests and not eng.waiting and not eng.running
    with pytest.raises(RuntimeError, match="injected scheduler bug"):
        await eng.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["stopped", "never_started"])
async def test_shutdown_grace_serves_the_requests_a_stopped_engine_holds(how):
    """shutdown(grace_s) lets the requests already queued finish within the grace. On an engine whose
    loop stop_loop() ended (it leaves waiting requests queued for start()) or that never started,
    they were aborted at once, the grace ignored (regression): the grace now runs the loop for them."""
    eng = make_engine()
    if how == "stopped":
        await eng.start()
        await eng.stop_loop()
    reqs = [eng.add_request([1 + i, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)) for i in range(2)]
    await asyncio.wait_for(eng.shutdown(grace_s=HANG_GUARD_S), HANG_GUARD_S * 2)
    for req in reqs:
        assert req.state.value == "finished" and req.finish_reason == "length" and len(req.output) == 5
    assert eng.stats["aborted"] == 0 and not eng.requests
    assert eng._loop_task is None
    with pytest.raises(RequestError, match="has shut down"):
        eng.add_request([1, 2, 3])


async def decoding_with_hicache() -> tuple[Engine, object]:
    """An engine with L2 and an L3 file, running one request of 64 tokens that has begun to decode."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE, num_pages=128, max_new_tokens_limit=64)
                 .with_hicache(enable=True))
    await eng.start()
    req = eng.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=64, ignore_eos=True))
    while not req.output:
        await asyncio.sleep(0.001)
    return eng, req


@pytest.mark.asyncio
async def test_a_shutdown_cancelled_during_its_grace_still_stops_the_loop_and_closes_the_tiers():
    """Regression (session 40): a shutdown's task cancelled while it waited for the grace (as
    `asyncio.wait_for(engine.shutdown(30), 5)` does) left the loop running its requests, every
    transfer undrained and the tiers open, the engine refusing new requests: closed by nothing."""
    eng, req = await decoding_with_hicache()
    task = asyncio.ensure_future(eng.shutdown(HANG_GUARD_S))
    await asyncio.sleep(0)  # (in its grace wait)
    assert eng.running, "the request ended before the cancel: the test no longer tests the grace wait"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, HANG_GUARD_S)
    assert eng._loop_task is None and req.state.done and req.finish_reason == "abort"
    assert not eng.cache.runner.live and eng.cache.store.closed
    eng.check_integrity()
    await asyncio.wait_for(eng.shutdown(), HANG_GUARD_S)  # a later attempt ends too


@pytest.mark.asyncio
async def test_a_shutdown_cancelled_in_its_grace_closes_the_tiers_though_the_loop_crashes_stopping(monkeypatch):
    """The loop, told to stop by a shutdown cancelled in its grace, crashes on the way: the crash is the
    loop's (logged, its requests failed), the cancel still propagates and the tiers are closed."""
    eng, req = await decoding_with_hicache()
    settle = eng._settle_aborts

    def crash_once_stopping():
        if eng.stopping and asyncio.current_task() is eng._loop_task:
            raise RuntimeError("injected crash while stopping")
        settle()
    monkeypatch.setattr(eng, "_settle_aborts", crash_once_stopping)
    task = asyncio.ensure_future(eng.shutdown(HANG_GUARD_S))
    await asyncio.sleep(0)
    assert eng.running
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, HANG_GUARD_S)
    assert eng._loop_task is None and req.state.done
    assert not eng.cache.runner.live and eng.cache.store.closed
    eng.check_integrity()

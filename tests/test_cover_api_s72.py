"""The HTTP server's error paths no other test executed (session 72's coverage hunt, area api).

Pinned here, each through the ASGI app (its own lifespan, the tiny preset on the CPU):
- a client that leaves while /tokenize, /detokenize or /reset_prefix_cache reads its body is answered 499, not a 500
  (api_tokenize._read_body, api_admin.PrefixCacheReset);
- a Content-Length that is not a number is a 400 naming the header (api_models.read_json_body);
- `suffix` on a completion is a 400 naming the field (api_models.CompletionRequest.check_unsupported);
- a request the engine refuses after its loop crashed (here: during the request's grammar compile, off the loop) is a
  503 engine_failed naming the crash, not a 400 blaming the prompt (server._refused);
- /version says "unknown" where the package is not installed (server._version);
- jsonable's conversions of what /hicache/status may hold: enums, dataclasses, tensor scalars, anything else as text.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import importlib.metadata
import json
import threading

import pytest
import pytest_asyncio
import torch

from scheduler import server
from scheduler.api_models import jsonable, validation_error
from scheduler.request import SamplingParams
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer
from test_server_crash_hunt import HANG_GUARD_S, ASGICall, error_of, make_engine, post_scope


async def _call(app, path: str, messages: list[dict], headers: list | None = None, method: str = "POST") -> list:
    """One request to the app whose client sends `messages`, then stays connected (a last http.disconnect: gone for
    good); what the app sent back."""
    scope = post_scope(path, b"")
    scope["method"] = method
    scope["headers"] = headers if headers is not None else [(b"content-type", b"application/json")]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages and (len(messages) > 1 or messages[0]["type"] != "http.disconnect"):
            return messages.pop(0)
        if messages:
            return messages[0]
        await asyncio.Event().wait()  # (connected, nothing more to say: cancelled when the app is done)

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), HANG_GUARD_S)
    return sent


def _status_and_json(sent: list[dict]) -> tuple[int, dict | None]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body) if body else None


@pytest_asyncio.fixture
async def app():
    eng = make_engine()
    app = create_app(eng, ServerLimits(shutdown_grace_s=0.0), tokenizer=ByteTokenizer(eng.vocab_size))
    async with app.router.lifespan_context(app):
        app.engine = eng
        yield app


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/reset_prefix_cache"])
async def test_a_client_gone_mid_body_of_an_admin_route_is_a_499_not_a_500(app, path):
    """The body's read raised starlette's ClientDisconnect: answered 499 (client closed request), as the generation
    routes do; uncaught it was the app's 500 (internal_error), logged as a bug."""
    sent = await _call(app, path, [{"type": "http.request", "body": b'{"prompt": "h', "more_body": True},
                                   {"type": "http.disconnect"}])
    status, body = _status_and_json(sent)
    assert status == 499 and body is None, sent


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
@pytest.mark.parametrize("length", [b"12x", b"-1", b" 5"])
async def test_a_content_length_that_is_no_number_is_a_400_naming_the_header(app, path, length):
    body = b'{"prompt": "hi"}'
    sent = await _call(app, path, [{"type": "http.request", "body": body, "more_body": False}],
                       headers=[(b"content-type", b"application/json"), (b"content-length", length)])
    status, answer = _status_and_json(sent)
    assert status == 400 and answer["error"]["code"] == "invalid_header", answer
    assert "Content-Length" in answer["error"]["message"]


@pytest.mark.asyncio
async def test_suffix_on_a_completion_is_a_400_naming_the_field(app):
    """vLLM refuses an insertion's suffix too; taken silently, the answer would not be the insertion asked for."""
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "suffix": "end"}).encode()
    sent = await _call(app, "/v1/completions", [{"type": "http.request", "body": body, "more_body": False}])
    status, answer = _status_and_json(sent)
    assert status == 400, answer
    assert answer["error"]["param"] == "suffix" and answer["error"]["code"] == "unsupported_value", answer
    assert not app.engine.requests and app.state.hc.in_flight == 0


@pytest.mark.asyncio
async def test_a_refusal_after_the_loop_crashed_during_the_grammar_compile_is_a_503_engine_failed(app, monkeypatch):
    """A guided request's grammar compiles off the loop (an await); the engine loop crashes meanwhile, so the
    engine then refuses the request. That refusal is the server's fault: a 503 engine_failed naming the crash (as any
    request after a crash), not a 400 invalid_request that tells the client its prompt was bad."""
    eng = app.engine
    entered, go = threading.Event(), threading.Event()
    real_check = eng.guides.check

    def held_check(spec):  # (in the executor's thread: the loop runs on)
        entered.set()
        go.wait(HANG_GUARD_S)
        return real_check(spec)
    monkeypatch.setattr(eng.guides, "check", held_check)
    guided = ASGICall(app, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                                               "guided_regex": "[a-z]+"})
    guided.send_body()
    assert await asyncio.wait_for(asyncio.to_thread(entered.wait, HANG_GUARD_S), HANG_GUARD_S)

    def broken():
        raise RuntimeError("injected scheduler bug")
    monkeypatch.setattr(eng.admission, "decode_batch", broken)
    first = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    while not (ev := await asyncio.wait_for(first.queue.get(), HANG_GUARD_S)).finished:
        pass
    assert ev.finish_reason == "error"
    await asyncio.wait([eng._loop_task], timeout=HANG_GUARD_S)
    assert eng._loop_task.done()  # (the loop has crashed while the request's grammar compiled)
    go.set()
    status, body = await guided.answer()
    err = error_of(body, False)
    assert status == 503 and err["code"] == "engine_failed" and "injected scheduler bug" in err["message"], body
    assert not eng.requests and not eng.waiting and app.state.hc.in_flight == 0


@pytest.mark.asyncio
async def test_version_is_unknown_where_the_package_is_not_installed(app, monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    sent = await _call(app, "/version", [{"type": "http.request", "body": b"", "more_body": False}], method="GET")
    assert _status_and_json(sent) == (200, {"version": "unknown"})
    assert server._version() == "unknown"


class _Tier(enum.Enum):
    L1 = "l1"


@dataclasses.dataclass
class _Pages:
    used: int
    share: float


class _Opaque:
    def __str__(self) -> str:
        return "opaque!"


def test_jsonable_unwraps_enums_dataclasses_and_scalars_and_writes_the_rest_as_text():
    got = jsonable({"tier": _Tier.L1, "pages": _Pages(3, float("inf")), "t": torch.tensor(2.5),
                    "nan": torch.tensor(float("nan")), "i": torch.tensor(7), "o": _Opaque(), "big": torch.ones(2)})
    assert got == {"tier": "l1", "pages": {"used": 3, "share": None}, "t": 2.5, "nan": None, "i": 7,
                   "o": "opaque!", "big": str(torch.ones(2))}  # (a tensor of 2 has no .item(): its text)
    json.dumps(got, allow_nan=False)  # (JSON-safe: what JSONResponse writes)


def test_validation_error_of_no_errors_is_a_plain_400():
    """(Defensive: FastAPI's and pydantic's errors are never empty; a 400 all the same, never a 500.)"""
    err = validation_error(object())
    assert err.status == 400 and err.body()["error"]["code"] == "invalid_request"

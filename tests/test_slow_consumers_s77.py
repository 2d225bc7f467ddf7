"""Session 77's hunt of slow, stalled and vanished consumers: a streaming client whose TCP send buffer is full
(uvicorn's `send` then waits for the transport to drain: here, the app called through ASGI with a `send` that
blocks until the test lets it go). The tiny preset on the CPU behind the byte-level tokenizer.

Found: a stream of n > 1 choices with continuous_usage_stats gave each chunk the tokens its choice had been read up to
(each choice is read by a task of its own, ahead of its client), not its own: a client that fell behind was told
completion_tokens of tokens it had not been sent yet. (A stalled stream of one choice, once read only as its client
took its chunks, is read ahead too now: tests/test_read_ahead_s77.py.)
"""
from __future__ import annotations

import asyncio
import json

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_server_text import _write_byte_level_tokenizer

PROMPT = "hello world"


class _Client:
    """One HTTP request to `app` through ASGI (spec 2.3, as uvicorn's): its body sent at once; its response's body
    chunks kept. stall_after: after that many body chunks, `send` blocks (a client that reads no more, its TCP
    buffer full) until `resume()`."""

    def __init__(self, app, path: str, body: dict, stall_after: int | None = None) -> None:
        self.chunks: list[bytes] = []
        self.stalled, self._go, self._gone = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._stall_after, self._body = stall_after, json.dumps(body).encode()
        self._sent_body = False
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80)}
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> dict:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            self.chunks.append(message["body"])
            if self._stall_after is not None and len(self.chunks) >= self._stall_after and not self._go.is_set():
                self.stalled.set()
                await self._go.wait()

    def resume(self) -> None:
        self._go.set()

    async def events(self) -> list[dict]:
        """The stream's data events once it ended (its `[DONE]` checked and left out)."""
        await asyncio.wait_for(self.task, 60)
        lines = [ln[6:] for ln in b"".join(self.chunks).decode().split("\n\n") if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]", lines[-3:]
        return [json.loads(ln) for ln in lines[:-1]]

    async def json(self) -> dict:
        await asyncio.wait_for(self.task, 60)
        return json.loads(b"".join(self.chunks))


@pytest.fixture
def served(tmp_path):
    _write_byte_level_tokenizer(tmp_path)
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, max_new_tokens_limit=400))
    app = create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=HFTokenizer(str(tmp_path)))
    return engine, app


async def _until(predicate, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _outcomes(app) -> dict[str, float]:
    """hicache_requests_total by outcome, as /metrics renders them."""
    out = {}
    for line in app.state.hc.metrics.render().decode().splitlines():
        if line.startswith("hicache_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('outcome="')[1].split('"')[0]] = float(value)
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("n", [1, 2])
async def test_a_stalled_streams_continuous_usage_counts_each_chunks_own_tokens(served, n):
    """stream_options.continuous_usage_stats: each choice's chunk carries its choice's tokens so far, as sent, even
    where the client fell behind its choices' tokens (it took one chunk, then read nothing until the engine had
    ended every choice); the usage chunk counts them all (regression: with n = 2 every chunk sent after the stall
    said 8, the tokens its choice had been read up to)."""
    engine, app = served
    await engine.start()
    try:
        body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "n": n, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        client = _Client(app, "/v1/completions", body, stall_after=1)
        await asyncio.wait_for(client.stalled.wait(), 60)
        await _until(lambda: not engine.requests)
        client.resume()
        events = await client.events()
        sent = dict.fromkeys(range(n), 0)
        for event in events[:-1]:
            [choice] = event["choices"]
            sent[choice["index"]] += 1  # (one chunk a token: no stop, no echo)
            assert event["usage"]["completion_tokens"] == sent[choice["index"]], (choice["index"], event["usage"])
        assert sent == dict.fromkeys(range(n), 8)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8 * n
    finally:
        await engine.shutdown()

"""Session 77's hunt of a stream's read-ahead: each choice's engine request read by a task of its own, ahead of its
client (scheduler/choices.py's `merge`), and the usage of a stream cut short. The tiny preset on the CPU, called
through ASGI with a `send` that blocks (test_slow_consumers_s77's `_Client`: a client whose TCP buffer is full).

Found: a stalled stream of one choice was read only as its client took its chunks, so its stop string was matched
only then: the engine ran its request on to max_tokens meanwhile, its pages held, for nobody. And a stream cut short
(n > 1: read ahead already) counted in its usage's completion_tokens the tokens read ahead but never rendered, while
its reasoning_tokens counted those rendered: an all-reasoning output had more completion tokens than reasoning ones.
"""
from __future__ import annotations

import asyncio

import pytest

import scheduler.server
from scheduler.choices import Choices
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_responses_api import TEMPLATE
from test_slow_consumers_s77 import PROMPT, _Client, _outcomes, _until, served  # noqa: F401
from tokenizer_files import write_byte_tokenizer


def _stop_string(text: str) -> tuple[str, int]:
    """Three characters of the greedy answer (no replacement character), first found at their place, 4 or more
    characters in: a stop string that ends it there."""
    for at in range(4, len(text) - 3):
        stop = text[at:at + 3]
        if "\ufffd" not in stop and text.find(stop) == at:
            return stop, at
    raise AssertionError(f"no stop string in {text!r}")


@pytest.mark.asyncio
async def test_a_stalled_streams_stop_string_ends_its_engine_request_at_once(served):  # noqa: F811
    """A stream (n = 1) with a stop string whose client takes its first chunk, then reads no more: its engine request
    ends ("stop") once the string is matched, not after its 300 tokens (regression: matched only as the client read,
    the engine ran on to max_tokens); let go, the client gets the text before the stop string, finish_reason
    "stop", and the request counts once, as a success; every page is back."""
    engine, app = served
    await engine.start()
    try:
        body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        text = (await _Client(app, "/v1/completions", body).json())["choices"][0]["text"]
        stop, at = _stop_string(text)
        decoded_before = engine.stats["decode_tokens"]
        client = _Client(app, "/v1/completions", {**body, "stream": True, "stop": [stop]}, stall_after=1)
        await asyncio.wait_for(client.stalled.wait(), 60)
        await _until(lambda: not engine.requests)  # (its engine request ended while its client read nothing)
        decoded = engine.stats["decode_tokens"] - decoded_before
        assert decoded < 100, f"{decoded} tokens decoded for a stop string {at} characters in"
        client.resume()
        events = await client.events()
        assert "".join(e["choices"][0]["text"] for e in events) == text[:at]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        assert _outcomes(app) == {"success": 2.0, "aborted": 0.0, "failed": 0.0, "rejected": 0.0}
        assert app.state.hc.in_flight == 0
    finally:
        await engine.shutdown()
    engine.check_integrity()
    assert engine.cache.l1.allocator.num_private() == 0


@pytest.fixture
def thinking(tmp_path, monkeypatch):
    """An app with --reasoning-parser qwen3 whose template opens a think block for the prompt "think"; the Choices
    it serves kept in the list returned (to read a cut-short stream's usage, which no client is sent)."""
    path = write_byte_tokenizer(tmp_path, added=("<think>", "</think>"), config={"chat_template": TEMPLATE})
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, max_new_tokens_limit=400))
    app = create_app(engine, ServerLimits(shutdown_grace_s=1.0, reasoning_parser="qwen3"),
                     tokenizer=HFTokenizer(str(path)))
    served: list[Choices] = []

    class Kept(Choices):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            served.append(self)

    monkeypatch.setattr(scheduler.server, "Choices", Kept)
    return engine, app, served


@pytest.mark.asyncio
@pytest.mark.parametrize("n", [1, 2])
async def test_a_stream_cut_short_while_thinking_counts_as_many_reasoning_tokens_as_completion_tokens(thinking, n):
    """A chat stream of n choices that think to the end (no "<think>" / "</think>" sampled: the prompt opened the
    block), whose client takes two chunks, then reads no more while its choices are read ahead to their end, then
    goes away: the usage so far (Choices.usage_body, what a cancelled background response reports) counts the
    tokens rendered in both completion_tokens and reasoning_tokens (regression: with n = 2, completion_tokens were
    the 2 * 24 read, reasoning_tokens the few rendered)."""
    engine, app, served = thinking
    await engine.start()
    try:
        body = {"messages": [{"role": "user", "content": "think"}], "max_tokens": 24, "temperature": 0, "n": n,
                "stream": True, "ignore_eos": True, "logit_bias": {"256": -100, "257": -100}}
        client = _Client(app, "/v1/chat/completions", body, stall_after=n + 1)  # (the roles, one token)
        await asyncio.wait_for(client.stalled.wait(), 60)
        await _until(lambda: not engine.requests)  # (every choice read to its end meanwhile)
        client._gone.set()  # (the client goes away, its send still blocked: the stream is cancelled)
        await asyncio.wait_for(client.task, 60)
    finally:
        await engine.shutdown()
    [choices] = served
    usage = choices.usage_body()
    reasoning = usage["completion_tokens_details"]["reasoning_tokens"]
    assert 1 <= reasoning == usage["completion_tokens"] < 24 * n, usage
    engine.check_integrity()

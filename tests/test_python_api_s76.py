"""The in-process API as a library user drives it (session 76's hunt: consumers of Engine that HTTP never is).

- A prompt refused in a batch (`Engine.generate_async`) that asked for prompt_logprobs has [] as one that failed
  later has, as its logprobs already had (regression: None, a TypeError for a caller reading them all).
- add_request from a thread other than the one whose event loop runs the engine's loop is refused, as submit(),
  generate() and start() refuse it (regression: queued where that loop never saw it, it waited forever); between
  two run_until_complete() calls of the loop's own thread it is still taken.
- shutdown(grace_s) on a new event loop, after an asyncio.run() that ended the engine's loop by cancelling it, lets
  the requests it left finish within the grace, as it does after stop_loop() (regression: aborted at once)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams


def make_engine() -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4).with_hicache(enable=True))


def assert_whole(eng: Engine) -> None:
    eng.check_integrity()
    alloc = eng.cache.l1.allocator
    assert alloc.num_private() == 0 and not eng.requests


@pytest.mark.asyncio
async def test_a_refused_prompt_that_asked_for_prompt_logprobs_has_an_empty_list():
    eng = make_engine()
    params = SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=1)
    out = await eng.generate_async([[1, 2, 3], []], params)
    assert [r.finish_reason for r in out] == ["length", "error"], out
    assert len(out[0].prompt_logprobs) == 3 and out[1].prompt_logprobs == [], out[1]
    assert out[1].logprobs == []
    plain = await eng.generate_async([[]], SamplingParams(max_tokens=2))  # (not asked: None, as a served one's)
    assert plain[0].prompt_logprobs is None and plain[0].logprobs is None
    await eng.shutdown()


class LoopThread:
    """The engine's loop run by an event loop in a thread of its own (a library user's background loop)."""

    def __init__(self, eng: Engine) -> None:
        self.eng, self.loop = eng, asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def __enter__(self) -> "LoopThread":
        self.thread.start()
        self.call(self.eng.start())
        return self

    def __exit__(self, *exc) -> None:
        self.call(self.eng.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=60)
        self.loop.close()


def test_add_request_from_another_thread_than_the_engines_loop_is_refused():
    eng = make_engine()
    with LoopThread(eng) as background:
        with pytest.raises(RuntimeError, match="another event loop"):  # (a plain thread: no loop of its own)
            eng.add_request([1, 2, 3], SamplingParams(max_tokens=2))

        async def from_own_loop():
            eng.add_request([1, 2, 3], SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="another event loop"):
            asyncio.run(from_own_loop())
        assert not eng.requests and not eng.waiting

        async def on_its_loop():  # (where it belongs, it serves)
            req = eng.add_request([1, 2, 3], SamplingParams(max_tokens=2))
            while not (await req.queue.get()).finished:
                pass
            return req.result()
        result = background.call(on_its_loop())
        assert result.finish_reason == "length" and len(result.output_ids) == 2
    assert_whole(eng)


def test_add_request_between_run_until_complete_calls_of_the_loops_own_thread_is_taken():
    eng = make_engine()
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(eng.start())
        req = eng.add_request([1, 2, 3], SamplingParams(max_tokens=2))  # (no loop runs now: this thread's own)

        async def ended():
            while not (await req.queue.get()).finished:
                pass
        loop.run_until_complete(asyncio.wait_for(ended(), 60))
        assert req.finish_reason == "length" and len(req.output) == 2
        loop.run_until_complete(eng.shutdown())
    finally:
        loop.close()
    assert_whole(eng)


def test_a_shutdown_grace_after_an_asyncio_run_that_cancelled_the_loop_finishes_the_requests_left():
    eng = make_engine()
    reqs = []

    async def main():  # (queues its requests and returns: asyncio.run cancels the engine's loop task)
        await eng.start()
        reqs.extend(eng.add_request([1, 2, 3, i], SamplingParams(max_tokens=3)) for i in range(3))
        while not any(r.state.value == "prefill" for r in reqs):
            await asyncio.sleep(0)
    asyncio.run(main())
    assert eng._loop_task.cancelled() and not any(r.state.done for r in reqs)
    asyncio.run(eng.shutdown(grace_s=60))
    assert [(r.finish_reason, len(r.output)) for r in reqs] == [("length", 3)] * 3
    assert eng.cache.store.closed
    assert_whole(eng)

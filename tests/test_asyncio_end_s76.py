"""A library user's asyncio.run() that ends (no stop_loop()) while a task of its streams a request from
`Engine.submit` (session 76). asyncio.run cancels every task left: the consumer's `submit` aborts its request as it
closes, and the engine's loop task drains the copies in flight before it ends. The abort landed while the loop task
was still draining, so nothing settled it: once the run was over the request was still listed running (DECODE, in
`status()`'s count, not counted aborted), held its L1 pages, and stayed so until some later loop ran. The loop task now
ends the aborts that landed while it drained, as the loop's own tick would have."""
from __future__ import annotations

import asyncio

from hicache_helpers import assert_whole
from scheduler.request import SamplingParams
from test_beam_search import PROMPT, make_engine


def test_a_stream_aborted_as_an_asyncio_run_ends_leaves_no_request_running():
    eng = make_engine()

    async def main():
        await eng.start()
        streaming = asyncio.Event()

        async def consume():
            async for _ in eng.submit(PROMPT, SamplingParams(max_tokens=1000), rid="r1"):
                streaming.set()
        asyncio.ensure_future(consume())
        await streaming.wait()
        # main returns: asyncio.run cancels the consumer, whose stream aborts r1, and the engine's loop task
    asyncio.run(main())
    assert not eng.requests and not eng.aborting
    status = eng.status()["engine"]
    assert status["running"] == 0 and status["aborted"] == 1
    assert_whole(eng.cache)
    [again] = eng.generate([PROMPT], SamplingParams(max_tokens=2))  # (the engine serves on)
    assert again.finish_reason == "length"
    asyncio.run(eng.shutdown())

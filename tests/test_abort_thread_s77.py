"""Session 77: `Engine.abort()` from another event loop than the one the engine's loop runs on is refused, as
`add_request` is (session 76). It was taken: from another thread it woke the loop through a thread-unsafe Event.set
(missed while the loop slept) and ended a parked request there, under the running loop."""
from __future__ import annotations

import asyncio

import pytest

from scheduler.request import SamplingParams
from test_python_api_s76 import LoopThread, assert_whole, make_engine


def test_abort_from_another_threads_event_loop_is_refused_and_the_request_runs_on():
    eng = make_engine()
    with LoopThread(eng) as background:
        async def add():
            return eng.add_request([1, 2, 3], SamplingParams(max_tokens=6))
        req = background.call(add())
        with pytest.raises(RuntimeError, match="another event loop"):
            asyncio.run(eng.abort(req.rid))
        assert req.rid not in eng.aborting

        async def ended():
            while not (await req.queue.get()).finished:
                pass
            return req.result()
        result = background.call(ended())
        assert result.finish_reason == "length" and len(result.output_ids) == 6
        assert background.call(eng.abort(req.rid)) is False  # (on its own loop: taken, an ended request's False)
    assert_whole(eng)


def test_abort_with_no_loop_running_is_taken():
    eng = make_engine()
    req = eng.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    assert asyncio.run(eng.abort(req.rid)) is True
    assert req.state.done and req.finish_reason == "abort"
    assert_whole(eng)

"""A library user's beam search whose step request the user aborted (`engine.abort` of `{rid}-beam{step}.{beam}`, the
names beam_search documents): the search ended with BeamSearchError saying "the server is shutting down or the client
went away", neither of which happened (session 76; a client gone cancels the search, and a cancelled search raises
CancelledError, never this error). A step aborted while the engine takes requests names that step's abort."""
from __future__ import annotations

import asyncio

import pytest

from hicache_helpers import finish
from scheduler.beam_search import BeamSearchError, BeamSearchParams, beam_search
from test_beam_search import PROMPT, make_engine, on_adds


def test_a_step_the_user_aborted_ends_the_search_naming_that_abort_not_a_shutdown():
    eng = make_engine(max_running_requests=1)  # (a step's second beam waits queued while its first runs)

    async def go():
        aborted = []
        on_adds(eng, 3, lambda: aborted.append(asyncio.ensure_future(eng.abort("mine-beam1.1"))))
        with pytest.raises(BeamSearchError) as err:
            await beam_search(eng, PROMPT, BeamSearchParams(beam_width=2, max_tokens=12), rid="mine")
        assert await aborted[0]
        assert err.value.finish_reason == "abort"
        assert "mine-beam1.1" in str(err.value)
        assert "shutting down" not in str(err.value) and "client" not in str(err.value)
        await finish(eng)
    asyncio.run(go())

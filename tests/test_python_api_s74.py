"""What the Python API (Engine.add_request with a SamplingParams) takes is what it checked (session 74's hunt: the
HTTP layer hands the engine tuples it built; a library user hands it their own objects, and may change them after).

- SamplingParams.validate keeps stop_token_ids as a tuple of the ids it checked, as it keeps logit_bias,
  allowed_token_ids and bad_words_token_ids (regression: a list was kept; a caller that reused it and appended a
  non-id after add_request crashed the loop, failing every other request; a valid id appended changed the stops of
  a request already queued)."""
from __future__ import annotations

import asyncio

import pytest

from test_faults import PROMPT, finish, make_engine, reference
from scheduler.request import SamplingParams


async def _ended(req) -> None:
    while not req.state.done:
        if (await req.queue.get()).finished:
            return


@pytest.mark.parametrize("appended", ["none", "first_token"])
@pytest.mark.asyncio
async def test_stop_token_ids_changed_after_add_request_change_nothing(appended):
    want = await reference(PROMPT, 4)
    eng = make_engine()
    await eng.start()
    stops = [want[3]]  # (never reached before max_tokens 3)
    other = eng.add_request(PROMPT, SamplingParams(max_tokens=4))
    req = eng.add_request(PROMPT, SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=stops))
    stops.append(None if appended == "none" else want[0])  # (the caller reuses its list)
    await asyncio.wait_for(asyncio.gather(_ended(other), _ended(req)), 30)
    assert (other.finish_reason, other.output) == ("length", want)
    assert (req.finish_reason, req.output) == ("length", want[:3])
    assert not eng._loop_task.done() and req.params.stop_token_ids == (want[3],)
    eng.check_integrity()
    await finish(eng)

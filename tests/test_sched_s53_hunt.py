"""Regressions from session 53's scheduling hunt: while requests decode, prefill and decode batches take turns, so
a decoding request waits at most one prefill forward for its next token (decode ran only once no prefill work was
left: every chunk of a long prompt stalled it, and short requests arriving one per forward starved it)."""
from __future__ import annotations

import asyncio

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams


def record_launches(eng: Engine) -> list[tuple[str, bool]]:
    """(kind of each launched batch, whether a request was decoding as it launched)."""
    launches, launch = [], eng._launch

    def recorded(work, chain=None):
        decoding = any(r.state is RequestState.DECODE for r in eng.running)
        launches.append(("D" if work.binput.is_decode else "P", decoding))
        return launch(work, chain)
    eng._launch = recorded
    return launches


async def drain(req) -> None:
    while not req.state.done:
        await asyncio.sleep(0.001)


def prefills_in_a_row_beside_decodes(launches) -> int:
    return sum(1 for (a, _), (b, decoding) in zip(launches, launches[1:]) if a == b == "P" and decoding)


@pytest.mark.asyncio
async def test_a_long_chunked_prompt_takes_turns_with_the_decodes():
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=2048, max_prefill_tokens=64))
    launches = record_launches(eng)
    await eng.start()
    decoding = [eng.add_request([3, 4, 5, i + 1], SamplingParams(max_tokens=200, ignore_eos=True)) for i in range(4)]
    while not all(len(r.output) > 2 for r in decoding):
        await asyncio.sleep(0.001)
    start = len(launches)
    long = eng.add_request([(i * 7) % 200 + 1 for i in range(1500)], SamplingParams(max_tokens=2))
    while long.first_token_s is None:
        await asyncio.sleep(0.001)
    during = launches[start:]
    assert [k for k, _ in during].count("P") >= 1500 // 64  # (its chunks)
    assert prefills_in_a_row_beside_decodes(during) == 0
    assert [k for k, _ in during].count("D") >= [k for k, _ in during].count("P") - 1  # (a decode step between chunks)
    for r in [*decoding, long]:
        await drain(r)
    assert all(len(r.output) == 200 for r in decoding)
    eng.cache.check_integrity()
    await eng.shutdown()


@pytest.mark.asyncio
async def test_short_requests_arriving_every_forward_do_not_starve_a_decode():
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=2048))
    launches, arrivals, feeding = record_launches(eng), [], [False]
    launch = eng._launch

    def arriving(work, chain=None):  # a one-token request arrives while each forward runs
        handle = launch(work, chain)
        if feeding[0]:
            n = len(arrivals)
            arrivals.append(eng.add_request([10 + n % 200, 11, 12, 13], SamplingParams(max_tokens=1)))
        return handle
    eng._launch = arriving
    await eng.start()
    dec = eng.add_request([3, 4, 5, 6], SamplingParams(max_tokens=4000, ignore_eos=True))
    while len(dec.output) < 2:
        await asyncio.sleep(0.001)
    before, feeding[0] = len(dec.output), True
    while len(arrivals) < 60:
        await asyncio.sleep(0.001)
    feeding[0] = False
    assert len(dec.output) - before >= 20  # (it decoded 1 token in 590 forwards)
    await eng.abort(dec.rid)
    for r in [*arrivals, dec]:
        await drain(r)
    assert all(r.finish_reason == "length" for r in arrivals)
    eng.cache.check_integrity()
    await eng.shutdown()

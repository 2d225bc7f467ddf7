"""Session 80's scheduling hunt (vLLM's scheduler as the reference): a request in decode that outgrew its L1
reservation waits a step where backups are copying L1 pages (`l1_room_coming`), for the room they free, rather
than preempt (scheduler/reservations.py `_grow_or_preempt`). But each prefill pass admitted queued requests on
that very room first: under write_through every short request that ended was backed up, its copy was the next
"room coming", and the next one took the room. A steady stream of short requests held a long one in decode
for good (17 of its 30 tokens after 600 short requests, never preempted, never failed). vLLM schedules its
running requests before it admits any, and admits none in a step where one of them lacked memory: here the
queue waits while a request in decode waits for L1 room (`Admission.room_waiters`)."""
from __future__ import annotations

import asyncio
import random

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams

SHORT_REQUESTS = 80  # (the long request needs ~20 of them to end beside it; without the fix it never finishes)


def _engine(ratio) -> Engine:
    cfg = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=10, decode_reserve_ratio=ratio)
    return Engine(cfg.with_hicache(enable=True, policy="always", host_ratio=4.0, transfer_backend="torch",
                                   write_policy="write_through"))


async def _ended(req) -> None:
    while not (await req.queue.get()).finished:
        pass


@pytest.mark.parametrize("ratio", [0.0, "auto"])
@pytest.mark.asyncio
async def test_a_stream_of_short_requests_does_not_hold_a_decoding_request_for_good(ratio):
    eng = _engine(ratio)
    await eng.start()
    rng = random.Random(0)
    long = eng.add_request([rng.randrange(1, 200) for _ in range(8)], SamplingParams(max_tokens=30, ignore_eos=True))
    shorts, live = 0, []
    while not long.state.done and shorts < SHORT_REQUESTS:
        while len(live) < 2:  # two short requests queued or running at all times
            live.append(eng.add_request([rng.randrange(1, 200) for _ in range(8)],
                                        SamplingParams(max_tokens=1, ignore_eos=True)))
            shorts += 1
        await _ended(live.pop(0))
    assert long.state is RequestState.FINISHED, (len(long.output), long.state, shorts)
    assert len(long.output) == 30 and long.finish_reason == "length"
    await asyncio.gather(*map(_ended, live))
    await eng.cache.drain()
    eng.check_integrity()
    assert eng.metrics()["failures"] == {}
    await eng.shutdown()

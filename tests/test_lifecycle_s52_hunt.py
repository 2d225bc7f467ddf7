"""Regressions from session 52's hunt of the engine loop's start and stop through the in-process API: a request
submitted while stop_loop() joined the loop task started a second loop that stop_loop() then orphaned (two loops ran
the same requests' batches: tokens delivered twice); a stop_loop() whose caller was cancelled left the loop stopping,
start() did nothing, and the requests queued were stranded while new ones were refused as "shutting down"."""
from __future__ import annotations

import asyncio

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def _engine(**overrides) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", num_pages=256, page_size=4, **overrides))


def _loops() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if "EngineLoop._loop" in repr(t.get_coro()) and not t.done()]


async def _tokens(eng: Engine, prompt: list[int], rid: str) -> list[int]:
    return [ev.token_id async for ev in eng.submit(prompt, PARAMS, rid=rid) if ev.token_id is not None]


@pytest.mark.asyncio
async def test_a_submit_while_stop_loop_ends_waits_for_it_then_runs_on_one_loop():
    prompts = {"a": [7] * 9, "b": [9] * 9, **{f"c{i}": [20 + i] * (5 + i) for i in range(4)}}
    ref = _engine(enable_prefix_cache=False)
    want = {rid: r.output_ids for rid, r in zip(prompts, await ref.generate_async(list(prompts.values()),
                                                                                  PARAMS))}
    await ref.shutdown()
    eng = _engine()
    await _tokens(eng, [5] * 9, "warm")
    old = eng._loop_task
    stopper = asyncio.ensure_future(eng.stop_loop())
    while not old.done():  # the loop ended; stop_loop() has not resumed from its join yet
        await asyncio.sleep(0)
    a = asyncio.ensure_future(_tokens(eng, prompts["a"], "a"))  # a client submits in that window
    await stopper
    others = [asyncio.ensure_future(_tokens(eng, p, rid)) for rid, p in prompts.items() if rid != "a"]
    await asyncio.sleep(0.01)
    assert len(_loops()) == 1
    got = await asyncio.wait_for(asyncio.gather(a, *others), 60)
    assert dict(zip(prompts, got)) == want
    await eng.shutdown()
    eng.check_integrity()
    assert not _loops()


@pytest.mark.asyncio
async def test_start_after_a_cancelled_stop_loop_resumes_the_queue():
    eng = _engine(max_running_requests=1)
    await eng.start()
    runs = [asyncio.ensure_future(_tokens(eng, [i + 1] * 9, f"r{i}")) for i in range(3)]  # r0 runs, r1 r2 queued
    while not eng.running:
        await asyncio.sleep(0.001)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(eng.stop_loop(), 0.001)
    with pytest.raises(RequestError, match="stopping"):  # (not "shutting down": start() resumes it)
        eng.add_request([99] * 5, PARAMS)
    await eng.start()
    assert not eng.stopping
    extra = asyncio.ensure_future(_tokens(eng, [99] * 5, "extra"))
    outs = await asyncio.wait_for(asyncio.gather(*runs, extra), 60)
    assert [len(o) for o in outs] == [12] * 4
    await eng.shutdown()
    eng.check_integrity()

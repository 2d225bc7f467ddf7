"""Who runs next, and in which order (session 74's hunt): ties between requests are broken by arrival, never by a
set's iteration order, which follows the process's hash seed (PYTHONHASHSEED), so the same requests in the same
order give the same schedule from one run to the next.

Pinned: requests aborted in one tick (an API stop string's `abort(stop=True)`, a client gone) end in arrival order,
so those that finish publish their K/V in that order and the prefix cache's LRU order (which it evicts first) is the
same in every run. (Regression: `_settle_aborts` walked the `aborting` set: two stop strings hit in one step ended
b-then-a under one hash seed and a-then-b under another, and so the cache evicted a different prompt first.)"""
from __future__ import annotations

import asyncio

import pytest

from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams


def _rids_the_set_reverses() -> tuple[str, str]:
    """Two request ids that a set built as `Engine.abort` builds `aborting` (a then b) iterates b first, in this
    process (its hash seed): found among candidates, each pair's order a coin toss."""
    for k in range(200):
        a, b = f"who-runs-a{k}", f"who-runs-b{k}"
        aborting = set()
        aborting.add(a), aborting.add(b)
        if list(aborting) == [b, a]:
            return a, b
    raise AssertionError("no pair of ids found that a set iterates in reverse")  # (odds 2**-200)


async def _until(cond, steps: int = 5000) -> None:
    for _ in range(steps):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not reached")


@pytest.mark.asyncio
async def test_requests_stopped_in_one_tick_end_and_publish_in_arrival_order_whatever_the_hash_seed():
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256))
    await eng.start()
    try:
        rids = _rids_the_set_reverses()
        reqs = [eng.add_request([10 * i + j + 1 for j in range(8)], SamplingParams(max_tokens=200, ignore_eos=True),
                                rid=rid) for i, rid in enumerate(rids)]
        await _until(lambda: all(len(r.output) >= 2 for r in reqs))  # (both decoding: a stop finishes them)
        ended, finish = [], eng.finish
        eng.finish = lambda req, *args, **kw: (ended.append(req.rid), finish(req, *args, **kw))[1]
        for rid in rids:  # (no await inside abort: the loop ends both at its next tick)
            assert await eng.abort(rid, stop=True)
        await _until(lambda: all(r.state.done for r in reqs))
        assert [r.finish_reason for r in reqs] == ["stop", "stop"]
        assert ended == list(rids)
        stamps = []  # their K/V's LRU stamps: the earlier stamp is evicted first
        for r in reqs:
            m = eng.cache.tree.match((r.prompt + r.output)[:8], include_storage=False, touch=False)
            stamps.append(m.handles[Tier.L1].stamp[Tier.L1])
        assert stamps[0] < stamps[1]
        eng.check_integrity()
    finally:
        await eng.shutdown()

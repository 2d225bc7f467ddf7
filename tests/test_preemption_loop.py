"""The loop stays live around preemptions (session 57's hunts): a preemption that empties a step, or a request that
ends while it resumes behind its overlapped restore, leaves the other requests running and the loop alive."""
from __future__ import annotations

import asyncio

import pytest

from hicache_helpers import until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams
from scheduler.speculative import SpeculativeConfig


@pytest.mark.parametrize("ratio", [0.0, "auto"])
@pytest.mark.asyncio
async def test_a_verify_step_whose_only_drafted_request_preempts_itself_leaves_the_others_decoding(ratio):
    """Regression (session 57's hunt): with speculation a verify step holds only the requests that draft; when its
    one drafted request outgrew L1 and preempted itself (the newest), the step came out empty, the tick ran nothing
    and the loop slept with a sampled request still in decode and the preempted one queued: both hung until some
    other request arrived. A preemption now wakes the loop to plan again."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=2, draft_policy="always")
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=18, decode_reserve_ratio=ratio,
                              speculative=spec))
    await eng.start()
    sampled = eng.add_request([11, 12, 13, 14], SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                                               ignore_eos=True))  # (never drafts)
    await asyncio.sleep(0)  # (the greedy one arrives later: the newest, the victim)
    greedy = eng.add_request([5, 6, 7, 8] * 2, SamplingParams(max_tokens=40, ignore_eos=True))
    await until(lambda: sampled.state.done and greedy.state.done, 60)
    assert greedy.preemptions >= 1 and len(sampled.output) == len(greedy.output) == 40
    roomy = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, decode_reserve_ratio=1.0))
    await roomy.start()
    alone = (await roomy.generate_async([greedy.prompt], SamplingParams(max_tokens=40, ignore_eos=True)))[0]
    assert greedy.output == alone.output_ids
    await eng.cache.drain()
    eng.cache.check_integrity()
    await eng.shutdown()
    await roomy.shutdown()


@pytest.mark.asyncio
async def test_a_resumed_request_stopped_behind_its_overlapped_restore_ends_without_crashing_the_loop():
    """Regression (session 57's liveness hunt): a preempted request whose K/V went to L2 resumes behind an overlapped
    restore; its stop string matching then (an abort with stop=True, what the server's stop strings call) finished
    it and published the pages the restore op still owned: AllocatorError, the loop crashed and every live request
    failed. It now ends with "stop" and its tokens so far, and the other request runs on."""
    cfg = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=16, decode_reserve_ratio=0.0,
                       overlap_schedule=False).with_hicache(enable=True, policy="always", host_ratio=4.0,
                                                            storage_ratio=0.0, transfer_backend="torch")
    eng = Engine(cfg)
    await eng.start()
    stopped = []

    async def stopper():  # a client whose stop string matched just as its request resumed behind its restore
        while True:
            for r in list(eng.running):
                if r.overlap_op is not None and r.output and r.rid not in stopped:
                    stopped.append(r.rid)
                    await eng.abort(r.rid, stop=True)
            await asyncio.sleep(0)
    task = asyncio.get_running_loop().create_task(stopper())
    a = eng.add_request([11, 12, 13, 14, 15, 16, 17, 18], SamplingParams(max_tokens=40, ignore_eos=True))
    await asyncio.sleep(0)
    b = eng.add_request([21, 22, 23, 24, 25, 26, 27, 28], SamplingParams(max_tokens=30, ignore_eos=True))
    try:
        await until(lambda: a.state.done and b.state.done, 60)
    finally:
        task.cancel()
    assert stopped == [b.rid] and b.preemptions == 1  # (the premise: it resumed behind an overlapped restore)
    assert (b.state, b.finish_reason, b.error) == (RequestState.FINISHED, "stop", None)
    assert (a.state, a.finish_reason, len(a.output)) == (RequestState.FINISHED, "length", 40)
    assert not eng._loop_task.done() and eng.stats["failed"] == 0
    await eng.cache.drain()
    eng.cache.check_integrity()
    await eng.shutdown()

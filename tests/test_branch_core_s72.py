"""Session 72 branch-coverage hunt, core (engine side): the sides of branches no test took, each pinned as the rule it
is.

- A request failed by its own work (its logprobs read) in the very forward that ran behind its layer-ordered L2
  restore, the restore already ended: the restore's adoption sees an ended request (`Restoring.adopt_restored`'s
  "aborted meanwhile" side) and takes nothing over: no lock of the finished request is left on the prefix (the
  cache is whole), the hit is not counted, and the published prefix serves the next request from L1.
- A logprobs read that raises for the step as a whole but for no request's rows alone is the batch's own bug
  (`step_extras._logprobs_or_fail`): it goes out and crashes the loop, as a mask raise no request makes alone does,
  instead of being swallowed with nobody failed (the step's tokens then lost) or blamed on an innocent request."""
from __future__ import annotations

import asyncio

import pytest

from hicache.radix import Tier
from scheduler.request import SamplingParams
from hicache_helpers import assert_whole, until
from test_faults import PROMPT, REUSABLE, finish, make_engine, reference, run_one
from test_raise_extras_s71 import HANG_GUARD_S, make, patch, prompts
from test_lifecycle_hunt import assert_whole as assert_engine_whole
from test_restore_overlap import _prefix_only_in_l2


@pytest.mark.asyncio
async def test_a_request_failed_in_its_overlapped_forward_takes_no_restored_prefix_over(monkeypatch):
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    await _prefix_only_in_l2(eng)
    real_collect = eng.runner.collect

    async def collect(handle):  # (the restore ends before its forward comes back, as on a GPU)
        ids = await real_collect(handle)
        ops = [r.overlap_op for r in eng.running if r.overlap_op is not None]
        await until(lambda: all(op.done for op in ops))
        return ids
    monkeypatch.setattr(eng.runner, "collect", collect)
    loop = eng._loop_task
    undo = patch(monkeypatch, eng.runner, "logprobs_of",
                 lambda handle, wants: wants is not None and any(w is not None for w in wants))
    [failed] = await asyncio.wait_for(
        eng.generate_async([PROMPT], SamplingParams(max_tokens=4, logprobs=1)), HANG_GUARD_S)
    undo()
    assert failed.finish_reason == "error" and "reading this request's logprobs" in failed.error, failed.error
    assert failed.output_ids == [] and eng.stats["restore_overlaps"] == 1 and eng._loop_task is loop
    assert eng.metrics()["hit_tokens"]["l2"] == 0, "the hit of a request that never took its restore over counted"
    await eng.cache.drain()
    assert_whole(eng.cache)  # (no lock of the failed request left on the restored prefix)
    assert eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).lengths[Tier.L1] == REUSABLE
    monkeypatch.setattr(eng.runner, "collect", real_collect)
    again = await asyncio.wait_for(run_one(eng), HANG_GUARD_S)
    assert again.output_ids == want and again.cached_tokens["l1"] == REUSABLE
    await eng.cache.drain()
    assert_whole(eng.cache)
    await finish(eng)


async def crashes_the_loop(monkeypatch, params: list[SamplingParams], name: str, raises, says: str = "") -> None:
    """`eng.runner.<name>` raises where `raises(handle, wants)`: every request of the step fails (`says` in its error)
    with the crashed loop, no request is blamed for it, and a new loop then serves the same outputs as before."""
    eng = make()
    clean = await asyncio.wait_for(eng.generate_async(prompts(eng), params), HANG_GUARD_S)
    loop = eng._loop_task
    undo = patch(monkeypatch, eng.runner, name, raises)
    out = await asyncio.wait_for(eng.generate_async(prompts(eng), params), HANG_GUARD_S)
    undo()
    assert all(r.finish_reason == "error" and says in r.error for r in out), [(r.finish_reason, r.error) for r in out]
    assert loop.done() and loop.exception() is not None
    assert eng.cache.metrics.failures.get("request_work", 0) == 0, "the batch's raise was blamed on a request"
    again = await asyncio.wait_for(eng.generate_async(prompts(eng), params), HANG_GUARD_S)
    assert [r.output_ids for r in again] == [r.output_ids for r in clean] and eng._loop_task is not loop
    assert_engine_whole(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_logprobs_raise_no_request_makes_alone_still_crashes_the_loop(monkeypatch):
    # raises whenever two rows' logprobs are read together, never for one request's rows alone
    params = [SamplingParams(max_tokens=6, logprobs=2)] * 2 + [SamplingParams(max_tokens=6)]
    await crashes_the_loop(monkeypatch, params, "logprobs_of",
                           lambda handle, wants: wants is not None and sum(w is not None for w in wants) > 1,
                           says="injected: logprobs_of raised")


@pytest.mark.asyncio
async def test_a_prompt_logprobs_raise_no_request_asked_for_still_crashes_the_loop(monkeypatch):
    """The step's prompt-logprobs read raises though no row asked for prompt logprobs: no request's work explains it,
    so it goes out and crashes the loop (each live request failed with it), as the logprobs read's does above; it is
    not swallowed as the rows of askers that ended since the launch are (test_cover_core_s72b.py)."""
    await crashes_the_loop(monkeypatch, [SamplingParams(max_tokens=6)] * 3, "prompt_logprobs_of",
                           lambda handle, wants: True)

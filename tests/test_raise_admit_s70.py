"""Session 70's raise hunt in admission: a request's restore-or-recompute decision, its prefix match, lock and room,
its publishing, its chunks and its preemption raising while other requests run.

A raise in admission's own bookkeeping crashes the engine loop, as any raise in the loop's per-step work does
(docs/reliability.md): every live request gets its error, new ones are refused until start(). Pinned here:
- the cost model's raise (a bug, a line gone wrong, a sample it refuses: LinearCost.observe's ValueError for a NaN)
  as it decided for one request (`CostPolicy.decide`) or learned a prefill's or a first token's time
  (`observe_prefill`, `observe_outcome`) crashed the loop, and every live request failed with it. The cost model
  only advises: now that request recomputes (the output of an engine without a cache) or the sample is dropped,
  counted as `failures.cost_model`, and the others go on;
- a loop crash in admission between a request's L1 lock on its prefix and its claim (`Admission._admit`,
  `Restoring._admit_overlapped`; the room beside a prefix, `_room_beside`, locks it too) left that lock held by no
  request, and failing the request did not release it: the prefix's L1 pages could never be evicted again (after
  start(), and until the process ended). Now the lock is taken with the claim that `release` gives back.
"""
from __future__ import annotations

import asyncio

import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole
from scheduler.loop_task import crash_of
from scheduler.request import RequestError, SamplingParams
from test_faults import OTHER, PROMPT, make_engine, reference
from test_raise_cache_s70 import RaiseOnce

HANG_GUARD_S = 20  # a client with no last event by then would wait forever
LONG = SamplingParams(max_tokens=60, ignore_eos=True)


async def _end(req) -> tuple[str, list[int]]:
    """(finish reason, output tokens); "hang" where no last event came within the guard."""
    out = []
    try:
        while True:
            ev = await asyncio.wait_for(req.queue.get(), HANG_GUARD_S)
            if ev.finished:
                return ev.finish_reason, out
            out.append(ev.token_id)
    except asyncio.TimeoutError:
        return "hang", out


async def _decoding(eng):
    """A long request beside the one the fault hits, already in decode."""
    other = eng.add_request(OTHER, LONG)
    first = await asyncio.wait_for(other.queue.get(), HANG_GUARD_S)
    assert not first.finished
    return other


COST_FAULTS = {  # where the cost model raises: (its object, the method, the error)
    "decide": (lambda cost: cost, "decide", RuntimeError("a bug in the cost model")),
    "predict": (lambda cost: cost.directions["h2d"], "predict", OverflowError("math range error")),
    "observe_prefill": (lambda cost: cost.directions["recompute"], "observe",
                        ValueError("cost sample must be finite and >= 0, got size=25 seconds=nan")),
    "observe_outcome": (lambda cost: cost.outcomes, "observe", ValueError("outcome times must be finite")),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("where", list(COST_FAULTS))
async def test_a_cost_model_that_raises_costs_one_request_its_restore_not_every_request(where):
    """The prompt's prefix is in L2 only; a request for it is decided (or, once its prefill ran, timed) while
    another one decodes (for a first token's outcome the request runs alone: only such a one is learned from).
    It gets the no-cache output, the other runs to its end, the loop is still up and the next request restores
    (regression: the loop crashed, both requests failed, every later one was refused until start())."""
    eng = make_engine(policy="cost")
    await eng.start()
    want = await reference(PROMPT)
    assert await _end(eng.add_request(PROMPT, SamplingParams(max_tokens=4))) == ("length", want)
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    other = await _decoding(eng) if where != "observe_outcome" else None
    where_obj, name, exc = COST_FAULTS[where]
    fault = RaiseOnce(where_obj(eng.cache.cost), name, exc)
    assert await _end(eng.add_request(PROMPT, SamplingParams(max_tokens=4))) == ("length", want)
    assert fault.calls >= 1, "the fault was never reached"
    if other is not None:
        reason, out = await _end(other)
        assert reason == "length" and len(out) == LONG.max_tokens - 1  # (its first token was read before)
    assert crash_of(eng._loop_task) is None
    assert eng.cache.metrics.failures.get("cost_model") == 1
    assert eng.cache.metrics.policy_skips["restore"] == 0  # (a failed decision is no policy's skip: counted once)
    restored = eng.cache.metrics.hit_tokens["l2"]
    if where in ("decide", "predict"):
        assert restored == 0  # (it recomputed)
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    assert await _end(eng.add_request(PROMPT, SamplingParams(max_tokens=4))) == ("length", want)
    assert eng.cache.metrics.hit_tokens["l2"] > restored  # (the next one's decision restores)
    await eng.cache.drain()
    assert_whole(eng.cache)
    assert eng.stats["failed"] == 0
    await eng.shutdown()


async def _l1_hit_over_l2(eng) -> list[int]:
    """L1 holds the first 3 pages of PROMPT, L2 all 6 (a prompt of them was served first, then PROMPT, and L1's
    LRU leaf evicted): PROMPT's admission locks that L1 prefix, and alone in its batch it restores the rest
    behind its forward (`_admit_overlapped`)."""
    assert (await _end(eng.add_request(PROMPT[:13], SamplingParams(max_tokens=1))))[0] == "length"
    assert (await _end(eng.add_request(PROMPT, SamplingParams(max_tokens=4))))[0] == "length"
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, 3)
    assert eng.cache.tree.match(PROMPT[:-1], touch=False).lengths[:2] == [12, 24]
    return PROMPT


ADMISSION_FAULTS = {  # a call admission makes between locking a request's L1 prefix and claiming it, and the prompt
    "note_hit": (lambda eng: eng.cache, "note_hit", False),
    "new_claim": (lambda eng: eng.cache, "new_claim", False),
    "room_beside": (lambda eng: eng.cache, "available_l1_pages", False),
    "overlapped_note_hit": (lambda eng: eng.cache, "note_hit", True),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("where", list(ADMISSION_FAULTS))
async def test_a_loop_crash_in_admission_leaves_no_l1_prefix_locked(where):
    """A request with an L1 hit is admitted while another decodes, and a call of its admission raises: the loop
    crashes and both requests get their error (as designed). After start() the engine serves, and once idle no
    node is locked (regression: the crashed admission's lock on the prefix stayed, held by no request, and its
    pages could never be evicted again)."""
    eng = make_engine()
    await eng.start()
    target, name, overlapped = ADMISSION_FAULTS[where]
    if overlapped:
        prompt, others = await _l1_hit_over_l2(eng), []
    else:
        assert (await _end(eng.add_request(PROMPT, SamplingParams(max_tokens=4))))[0] == "length"
        await eng.cache.drain()
        prompt, others = PROMPT + [9] * 5, [await _decoding(eng)]  # (its 24-token prefix an L1 hit)
    fault = RaiseOnce(target(eng), name, RuntimeError("a bug in admission"))
    req = eng.add_request(prompt, SamplingParams(max_tokens=4))
    for r in [req, *others]:
        assert (await _end(r))[0] == "error"
    assert fault.calls >= 1 and isinstance(crash_of(eng._loop_task), RuntimeError)
    with pytest.raises(RequestError, match="crashed"):
        eng.add_request(PROMPT, SamplingParams(max_tokens=4))
    await eng.start()
    assert await _end(eng.add_request(PROMPT, SamplingParams(max_tokens=4))) == ("length", await reference(PROMPT))
    await eng.cache.drain()
    eng.check_integrity()
    assert_whole(eng.cache)  # (no node locked: every L1 page can be evicted again)
    assert eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages) > 0
    assert eng.cache.l1.allocator.num_free == eng.cache.l1.num_pages
    await eng.shutdown()

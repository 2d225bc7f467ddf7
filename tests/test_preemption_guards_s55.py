"""Three of session 54's preemption fixes that no test guarded (session 55's mutation check): under "lpm" a resumed
request is ordered by the L1 its whole prefill (prompt and folded output) finds, not its prompt's; a resumed
request ending between its prefill's chunks backs up every chunk it published, the folded output's too; and one
failing on NaN K/V drops the whole prefix it reused, the output's pages too. Each
resumption here is made by hand as `Reservations.preempt` leaves one (output kept, `resumed_tokens` set), its
output taken from a run without preemption, so the scenario is certain."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from hicache.radix import Tier
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams
from test_preemption import config

PROMPT = list(range(30, 38))  # 2 pages of 4


def resumed(eng: Engine, output: list[int], folded: int, max_tokens: int = 40):
    """A request of PROMPT queued as a preemption after `folded` tokens of `output` leaves it."""
    req = eng.add_request(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    req.output, req.resumed_tokens, req.preemptions = list(output[:folded]), folded, 1
    req.served_hits = {"l1": 0, "l2": 0, "l3": 0}
    return req


@pytest.mark.asyncio
async def test_lpm_orders_a_resumption_by_what_l1_holds_of_its_whole_prefill():
    eng = Engine(dataclasses.replace(config(1.0), scheduling_policy="lpm"))
    [first] = await eng.generate_async([PROMPT], SamplingParams(max_tokens=14, ignore_eos=True))
    out = list(first.output_ids)  # (L1 holds PROMPT + out[:12]: 5 pages)
    await eng.stop_loop()
    other = eng.add_request(PROMPT + out[:4] + [1], SamplingParams(max_tokens=4))  # (L1 holds 12 of its tokens)
    resumption = resumed(eng, out, 12)  # (its prefill's 20 tokens: L1 holds 16 of the 19 it may reuse)
    assert eng.admission._admission_order() == [resumption, other]  # (regression: by its prompt, 4 held)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_resumption_ending_between_its_chunks_backs_up_the_output_it_published():
    cfg = dataclasses.replace(config(1.0, "l2"), max_prefill_tokens=4)  # (its prefill in chunks of 4 tokens)
    eng = Engine(cfg)
    [first] = await eng.generate_async([PROMPT], SamplingParams(max_tokens=14, ignore_eos=True))
    out = list(first.output_ids)
    await eng.stop_loop()
    await eng.cache.drain()
    await eng.cache.flush_async(Tier.L1, through_l3=True)
    eng.cache.flush(Tier.L2)
    eng.cache.flush(Tier.L3)  # (nothing cached: the resumption computes its 20 tokens)
    assert eng.cache.tree.match(PROMPT + out[:12], touch=False).lengths == [0, 0, 0]
    req = resumed(eng, out, 12)
    after_step, states = eng.admission.after_step, []

    def aborted_between_chunks(r, chunk, token, same_step=False):
        after_step(r, chunk, token, same_step)
        if r is req and r.locked_len >= 16 and not states:  # (4 chunks published: the prompt's 8, 8 of its output)
            states.append(r.state)
            eng.aborting.add(r.rid)  # (as Engine.abort: the next tick ends it, before its last chunk)
    eng.admission.after_step = aborted_between_chunks
    await eng.start()
    while not req.state.done:
        await asyncio.sleep(0.001)
    await eng.cache.drain()
    assert states == [RequestState.PREFILL] and req.finish_reason == "abort" and req.output == out[:12]
    backed = eng.cache.tree.match(PROMPT + out[:12], touch=False).lengths[Tier.L2]
    assert backed >= 16  # (regression: 8, the prompt's pages alone)
    eng.cache.check_integrity()
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_resumption_failing_on_its_outputs_nan_kv_drops_it_beside_a_request_locking_its_prompt():
    """The half of session 54's NaN fix no test guarded (session 55's mutation check): the resumption's reused
    tokens are sliced from its whole prefill. Sliced from the prompt alone, the drop stopped at the prompt's
    nodes, which another running request of that prompt locks: the poisoned output pages stayed, and the next
    request reusing them failed too."""
    eng = Engine(config(1.0))
    [first] = await eng.generate_async([PROMPT], SamplingParams(max_tokens=14, ignore_eos=True))
    out = list(first.output_ids)  # (L1 holds PROMPT + out[:12]: 5 pages)
    m = eng.cache.tree.match(PROMPT + out[:12], include_storage=False, touch=False)
    assert m.lengths[Tier.L1] == 20
    eng.cache.l1.kv[:, :, torch.tensor(m.pages[Tier.L1][2:], dtype=torch.int64)] = float("nan")  # (out's pages)
    other = eng.add_request(PROMPT + [1], SamplingParams(max_tokens=200, ignore_eos=True))  # (locks PROMPT's pages)
    while other.state is not RequestState.DECODE:
        await asyncio.sleep(0.001)
    req = resumed(eng, out, 12)  # (reuses PROMPT + out[:8]: 4 pages, 2 of them poisoned)
    while not req.state.done:
        await asyncio.sleep(0.001)
    assert req.finish_reason == "error" and eng.cache.metrics.failures["nan_logits"] == 1
    assert eng.cache.tree.match(PROMPT + out[:12], include_storage=False, touch=False).lengths[Tier.L1] == 8
    await eng.abort(other.rid)
    [again] = await eng.generate_async([PROMPT + out[:12] + [1]], SamplingParams(max_tokens=3))
    assert again.finish_reason == "length" and eng.cache.metrics.failures["nan_logits"] == 1
    eng.cache.check_integrity()
    await eng.shutdown()


def test_a_request_needing_exactly_the_room_left_has_not_outgrown_it():
    """(`Reservations._outgrew`: beyond its reservation by exactly the unreserved room left, it takes that room;
    counted as outgrown, a request preempted another needlessly. Session 55's mutation check: no test saw `>=`.)"""
    eng = Engine(config(0.0))
    adm = eng.admission
    req = eng.add_request(PROMPT, SamplingParams(max_tokens=8))  # (no pages, nothing reserved yet)
    adm.reserved_pages = eng.cache.available_l1_pages() - 2  # (2 pages of room left)
    assert not adm._outgrew(req, 8)  # (2 pages beyond)
    assert adm._outgrew(req, 9)  # (3)
    adm.reserved_pages = 0

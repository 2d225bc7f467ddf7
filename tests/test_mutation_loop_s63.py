"""Guards for the scheduler loop and the load the cost model prices (scheduler/engine_loop.py, scheduler/load.py):
rules that session 63's mutation check of both broke without a failing test."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hicache.config import HiCacheConfig
from hicache.cost_model import CostModel
from hicache.radix import MatchResult
from hicache_helpers import until
from scheduler import load
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import Request, RequestState, SamplingParams
from scheduler.speculative import SpeculativeConfig


# -- the load besides a request (scheduler/load.py) ----------------------------------------------------------------
def _req(rid, state, prefill_len, cached_len=0, max_tokens=8, output=(), prefetch_op=None):
    return SimpleNamespace(rid=rid, state=state, prefill_len=prefill_len, cached_len=cached_len,
                           params=SimpleNamespace(max_tokens=max_tokens), output=list(output), prefetch_op=prefetch_op)


def _engine(running, waiting, prefetch=True, aborting=(), max_prefill_tokens=2048):
    cost = CostModel(HiCacheConfig(), bytes_per_token=256)
    cost.directions["recompute"].fixed_s, cost.directions["recompute"].slope = 5e-3, 1e-6
    cache = SimpleNamespace(config=SimpleNamespace(prefetch=prefetch, policy="cost"), has_l2=True, cost=cost)
    return SimpleNamespace(cache=cache, running=running, waiting=waiting, aborting=set(aborting),
                           config=SimpleNamespace(max_prefill_tokens=max_prefill_tokens))


def test_writes_are_admitted_by_no_load_when_restores_block_the_loop():
    """With prefetch off a restore blocks the loop until it lands and nothing runs beside it, so no queued work
    hides a later read of what is written now: the writes' load is 0, as `busy_s`'s (write_busy_s)."""
    eng = _engine([_req("a", RequestState.PREFILL, 1000), _req("b", RequestState.DECODE, 10, 10, output=[1, 2])],
                  [_req("c", RequestState.WAITING, 3000)], prefetch=False)
    assert load.write_busy_s(eng) == 0.0 and load.busy_s(eng) == 0.0


def test_writes_with_no_running_request_are_admitted_by_the_whole_queue():
    """A backup asked for as a request finishes (it has left the running list) is admitted by all the work queued:
    with only waiting requests left, their prefill forwards (write_busy_s)."""
    eng = _engine([], [_req("c", RequestState.WAITING, 3000), _req("d", RequestState.WAITING, 500)])
    assert load.write_busy_s(eng) == pytest.approx(eng.cache.cost.busy_s(3500, 2))


def test_an_aborted_waiting_request_adds_no_load():
    """A waiting request aborted but not yet ended (the next tick ends it) will prefill nothing: it hides no
    read for another request (busy_s, write_busy_s)."""
    eng = _engine([], [_req("c", RequestState.WAITING, 3000), _req("d", RequestState.WAITING, 500)], aborting={"c"})
    cost = eng.cache.cost
    assert load.busy_s(eng) == pytest.approx(cost.busy_s(500, 1))
    assert load.write_busy_s(eng) == pytest.approx(cost.busy_s(500, 1))


def test_a_prefilling_request_adds_only_what_it_has_left_to_prefill():
    """A running request part-way through its prefill (chunked, or behind a cached prefix) adds only the tokens
    it has not computed yet: 3,000 of a 5,000-token prompt whose first 2,000 are cached, in two forwards."""
    eng = _engine([_req("a", RequestState.PREFILL, 5000, cached_len=2000, max_tokens=1)], [])
    assert load.busy_s(eng) == pytest.approx(eng.cache.cost.busy_s(3000, 2))


@pytest.mark.parametrize("max_tokens, output, decodes", [(1, [], False), (2, [7], True), (2, [7, 8], False)])
def test_a_request_adds_a_decode_step_only_where_it_has_tokens_left_to_decode(max_tokens, output, decodes):
    """A running request adds the decode step in flight only where it will decode: not a request of max_tokens 1
    (its prefill makes its only token), nor one that has all its tokens (busy_s)."""
    state = RequestState.PREFILL if not output else RequestState.DECODE
    eng = _engine([_req("a", state, 100, cached_len=100, max_tokens=max_tokens, output=output)], [])
    assert load.busy_s(eng) == pytest.approx(eng.cache.cost.busy_s(0, int(decodes)))


def test_a_resumed_request_is_priced_on_all_it_prefills():
    """A preempted request resumes by prefilling its prompt and the output it had: `pricing` gives the cost model
    that whole length as prompt_tokens, so its forwards are counted on what it really prefills."""
    req = Request(prompt=list(range(1, 101)), params=SamplingParams(max_tokens=4000), output=list(range(3000)))
    req.resumed_tokens = 3000
    eng = _engine([], [req])
    got = load.pricing(eng, req, MatchResult(lengths=[0, 2048, 0]))
    assert got["prompt_tokens"] == 3100 and got["chunk_tokens"] == 2048


# -- the loop's turns and chains (scheduler/engine_loop.py) ---------------------------------------------------------
def _record(eng: Engine) -> list[str]:
    """Each launched step's kind: P prefill, V verify, D a decode step the loop planned, C one chained on it."""
    kinds, launch = [], eng._launch

    def recorded(work, chain=None):
        b = work.binput
        kinds.append("P" if not b.is_decode and b.verify_drafts is None else "V" if not b.is_decode
                     else "C" if chain is not None else "D")
        return launch(work, chain)
    eng._launch = recorded
    return kinds


@pytest.mark.asyncio
async def test_a_chunked_prompt_gets_its_next_chunk_after_one_verify_step():
    """A verify step is decode's turn, as a decode step is: the next tick prefills the waiting prompt's next chunk,
    so a long prompt's chunks alternate with the verify steps of a request that drafts (it does not wait for the
    drafting request to end)."""
    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=2, draft_policy="always")
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=512, max_prefill_tokens=32,
                              speculative=spec))
    kinds = _record(eng)
    await eng.start()
    drafting = eng.add_request([5, 6, 7, 8] * 4, SamplingParams(max_tokens=400, ignore_eos=True))
    await until(lambda: "V" in kinds, 60)
    start = len(kinds)
    long = eng.add_request([(i * 7) % 200 + 1 for i in range(256)], SamplingParams(max_tokens=2))
    await until(lambda: long.first_token_s is not None, 60)
    during = "".join(kinds[start:])
    during = during[:during.rindex("P") + 1]
    assert during.count("P") >= 256 // 32 and "VV" not in during and "VD" not in during, during
    assert not drafting.state.done  # (the premise: it drafted all along)
    await eng.abort(drafting.rid)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_decode_steps_chain_on_right_after_a_short_prompts_prefill():
    """With overlap scheduling the decode step after a prefill (decode's turn) chains its next steps on the device
    unless a prompt is part-way through its chunks: a short request's arrival costs the decoding requests one
    unchained step, not two."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=512))
    kinds = _record(eng)
    await eng.start()
    decoding = [eng.add_request([3, 4, 5, i + 1], SamplingParams(max_tokens=200, ignore_eos=True)) for i in range(2)]
    await until(lambda: all(len(r.output) > 4 for r in decoding), 60)
    start = len(kinds)
    short = eng.add_request([9, 10, 11, 12], SamplingParams(max_tokens=60, ignore_eos=True))
    await until(lambda: len(short.output) > 8, 60)
    after = "".join(kinds[start:])
    after = after[after.index("P"):]
    assert after.startswith("PDC"), after
    for r in decoding + [short]:
        await eng.abort(r.rid)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_request_preempted_as_the_loop_stops_resumes_and_finishes():
    """stop_loop() lets the running requests finish, and a request preempted while it ran is one of them: it
    resumes once there is room and ends with all its tokens; the loop does not end with it left queued."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=16, decode_reserve_ratio=0.0))
    await eng.start()
    stops, preempt = [], eng.admission.preempt

    def preempting(req):
        preempt(req)
        if not stops:  # (the stop comes as the first preemption happens)
            stops.append(asyncio.get_running_loop().create_task(eng.stop_loop()))
    eng.admission.preempt = preempting
    a = eng.add_request([11, 12, 13, 14, 15, 16, 17, 18], SamplingParams(max_tokens=40, ignore_eos=True))
    await asyncio.sleep(0)
    b = eng.add_request([21, 22, 23, 24, 25, 26, 27, 28], SamplingParams(max_tokens=30, ignore_eos=True))
    await until(lambda: stops, 60)
    await asyncio.wait_for(stops[0], 60)
    assert a.preemptions + b.preemptions >= 1
    assert [(r.state, r.finish_reason, len(r.output)) for r in (a, b)] == [
        (RequestState.FINISHED, "length", 40), (RequestState.FINISHED, "length", 30)]
    assert not eng.waiting and not eng.parked
    eng.cache.check_integrity()
    await eng.shutdown()


def test_only_a_prefill_of_one_sequence_teaches_the_recompute_line():
    """A prefill forward of one sequence is timed into the cost model's recompute line (its intercept: a forward's
    fixed cost); a batch of several prompts is not one tail's forward and teaches it nothing."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=128))
    seen = []
    eng.cache.observe_prefill = lambda tokens, seconds: seen.append(tokens)
    eng.generate([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]], SamplingParams(max_tokens=1))  # (one batch of two)
    assert seen == []
    eng.generate([[21, 22, 23, 24, 25, 26, 27]], SamplingParams(max_tokens=1))
    assert seen == [7]

"""Scheduler guards found untested by session 56's mutation check of scheduler/reservations.py, restoring.py,
speculative.py and beam_search.py: at decode_reserve_ratio 1 nothing is preempted even with L1 wholly reserved; the
"auto" share rises after a preemption inside the engine; a preemption forgets its request's failed restore; under
"lpm" a blocked head behind another queued request stays blocked; a seeded request decodes between a greedy one's
verify steps; a follower scores as L3 exactly the whole pages the read it followed promoted for it; a failed
prefetch whose request recomputes counts a fallback; a beam search's later steps ask no prompt logprobs."""
from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpKind
from hicache.radix import Tier
from hicache_helpers import finish, until
from scheduler.beam_search import BeamSearchParams
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import Request, RequestState, SamplingParams
from scheduler.reservations import AutoReserveRatio
from scheduler.speculative import SpeculativeConfig, Speculator
from test_beam_search import PROMPT, run as run_beams
from test_beam_search import make_engine as beam_engine
from test_followups_hunt import reference
from test_preemption import config, mixed_params, prompt_of
from test_restore_bookkeeping_hunt import PAGE, VOCAB, make_engine, prefix_in_l3
from test_speculative import make_engine as spec_engine


# -- reservations ---------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("num_pages", [12, 16])
async def test_at_ratio_one_requests_grow_into_their_reservations_without_preemption(num_pages):
    """At decode_reserve_ratio 1 every page a request may write is reserved at admission, so nothing is ever
    preempted, even when the reservations take every page of L1: a request growing into pages it reserved
    takes them although no unreserved room is left."""
    eng = Engine(dataclasses.replace(config(1.0), num_pages=num_pages))
    await eng.start()
    try:
        reqs = [eng.add_request([i + 1] * 8, SamplingParams(max_tokens=9, ignore_eos=True)) for i in range(4)]
        await until(lambda: all(r.state.done for r in reqs), 60)
        assert eng.stats["preempted"] == 0
        assert all(r.state is RequestState.FINISHED and len(r.output) == 9 for r in reqs)
        eng.cache.check_integrity()
    finally:
        await eng.shutdown()


@pytest.mark.asyncio
async def test_a_preemption_in_the_engine_raises_the_auto_share_to_what_decode_used():
    """With decode_reserve_ratio "auto", each preemption the engine makes raises the share later admissions
    reserve to at least what the requests still in decode used of their max_tokens (each with 20 steps' margin,
    at most 1): admission turns cautious once L1 ran short, not only in AutoReserveRatio's own unit."""
    eng = Engine(config("auto"))
    seen, preempt = [], eng.admission.preempt

    def recorded(req):
        preempt(req)
        decoding = [r for r in eng.running if r.state is RequestState.DECODE]
        if decoding:
            used = sum(len(r.output) + AutoReserveRatio.MARGIN_STEPS for r in decoding)
            seen.append((eng.admission.reserve_ratio(), min(1.0, used / sum(r.params.max_tokens for r in decoding))))
    eng.admission.preempt = recorded
    await eng.start()
    try:
        reqs = [eng.add_request([i + 1] * 8, SamplingParams(max_tokens=100, ignore_eos=True)) for i in range(8)]
        await until(lambda: all(r.state.done for r in reqs), 60)
        assert eng.stats["preempted"] > 0 and seen
        assert all(share >= estimate for share, estimate in seen), seen
        assert any(estimate > AutoReserveRatio.START for _, estimate in seen), seen  # (a raise was due)
        assert all(len(r.output) == 100 for r in reqs)
    finally:
        await eng.shutdown()


@pytest.mark.asyncio
async def test_under_lpm_a_head_still_short_of_room_stays_blocked_behind_another_queued_request():
    """Under scheduling_policy "lpm" the request the last prefill pass stopped at for want of L1 room need not be
    the first queued; while it still waits and no room came back, it still counts as blocked (decode steps chain on
    rather than go back to a prefill pass that would only fail again), as a blocked first request does under fcfs."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=12, scheduling_policy="lpm"))
    await eng.generate_async([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=1))
    await eng.stop_loop()
    adm, cache = eng.admission, eng.cache
    first = eng.add_request([20, 21, 22], SamplingParams(max_tokens=2))
    head = eng.add_request([5, 6, 7, 8, 10, 11, 12, 13], SamplingParams(max_tokens=9, ignore_eos=True))
    m = cache.tree.match(adm._reusable(head), include_storage=False, touch=False)
    need = adm._pages_after(head, m.lengths[Tier.L1])
    adm.reserved_pages += adm._room_beside(m.handles[Tier.L1]) - need + 1  # (others' reservations: one page short)
    try:
        assert await adm._admit(head) is False and adm.memory_blocked[0] == head.rid
        assert eng.waiting[0] is first  # (the premise: the blocked request is not the queue's first)
        assert adm._head_still_blocked()
        adm.reserved_pages -= 1  # a page comes back: the head fits now
        assert not adm._head_still_blocked()
    finally:
        adm.reserved_pages = 0
        await eng.shutdown()


@pytest.mark.asyncio
async def test_a_preempted_request_whose_first_restore_failed_resumes_from_l2():
    """A request whose restore failed at its first admission recomputed its prompt; preempted later, its own K/V is
    what it resumes from, and that failure says nothing of it: where L1 evicted that K/V to L2 meanwhile, the
    resumption restores it from L2 rather than recompute it (as any resumption does)."""
    eng = Engine(config(0.0, "l2"))
    preempt = eng.admission.preempt

    def after_a_failed_restore(req):
        req.restore_failed = True  # (as a request whose first admission's restore failed)
        preempt(req)
    eng.admission.preempt = after_a_failed_restore
    await eng.start()
    try:
        reqs = [eng.add_request(prompt_of(i), mixed_params(i)) for i in range(12)]
        await until(lambda: all(r.state.done for r in reqs), 60)
        await eng.cache.drain()
        assert eng.stats["preempted"] > 0 and all(r.state is RequestState.FINISHED for r in reqs)
        assert eng.cache.metrics.restores_done > 0  # (some resumed from L2)
        eng.cache.check_integrity()
    finally:
        await eng.shutdown()


# -- speculative decoding ---------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_seeded_request_decodes_between_the_verify_steps_of_a_greedy_one(monkeypatch):
    """A seeded request never speculates; beside a greedy request that has a draft at every step, the loop
    alternates a verify step and a plain step of the seeded one, so the seeded request keeps streaming rather
    than wait for the greedy one to end."""
    def always_a_wrong_draft(self, req, k):
        return [0] if req.params.temperature == 0.0 else []
    monkeypatch.setattr(Speculator, "draft", always_a_wrong_draft)
    eng = spec_engine(SpeculativeConfig(3, prompt_lookup_max=2, prompt_lookup_min=2, draft_policy="always"))
    await eng.start()
    try:
        rng = random.Random(60)
        greedy = eng.add_request([rng.randrange(VOCAB) for _ in range(12)], SamplingParams(max_tokens=30))
        seeded = eng.add_request([rng.randrange(VOCAB) for _ in range(12)],
                                 SamplingParams(max_tokens=30, temperature=0.8, seed=3))
        await until(lambda: greedy.state.done, 60)
        seeded_when_greedy_ended = len(seeded.output)
        await until(lambda: seeded.state.done, 60)
        assert eng.speculator.stats["verify_steps"] >= 10  # (the premise: the greedy request verified)
        assert seeded_when_greedy_ended >= 10, seeded_when_greedy_ended
        assert len(seeded.output) == 30 and len(greedy.output) == 30
    finally:
        await eng.shutdown()


# -- beam search ------------------------------------------------------------------------------------
def test_a_beam_search_with_prompt_logprobs_still_reads_each_steps_prefix_from_the_cache():
    """prompt_logprobs belong to the search's first step only: the steps after it ask for none, so they read their
    beams' prefix from the prefix cache as a search without prompt_logprobs does, rather than compute every
    beam's whole sequence again at each step."""
    eng = beam_engine()
    steps, page = 5, eng.page_size
    got = run_beams(eng, PROMPT, BeamSearchParams(beam_width=2, max_tokens=steps, prompt_logprobs=2))
    assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(PROMPT)
    hits = got.cached_tokens_per_step
    assert len(hits) == steps
    for step, hit in enumerate(hits[1:], start=1):
        assert hit >= (len(PROMPT) + step - 1) // page * page, hits
    eng.check_integrity()


# -- a follower of another request's L3 read ------------------------------------------------------
def _l3_read(tokens, l2_start: int, l3_end: int, succeeded: bool = True, l1_room_lost: bool = False):
    return SimpleNamespace(kind=OpKind.RESTORE_L3, succeeded=succeeded,
                           payload={"tokens": tuple(tokens), "l2_start": l2_start, "l3_end": l3_end,
                                    "l1_room_lost": l1_room_lost})


def _follower(prompt: list[int], promoted: int = 0) -> Request:
    req = Request(prompt=prompt, params=SamplingParams(max_tokens=3))
    req.promoted_tokens = promoted
    return req


def test_a_follower_scores_as_l3_only_the_whole_pages_it_shares_with_the_read():
    """A queued request that waited for another's L3 read scores as L3 hits what that read promoted of its own
    prefix, counted in whole pages: a prompt sharing 10 tokens (2.5 pages) with the read counts 8, as only whole
    pages are cached."""
    eng = make_engine()
    rng = random.Random(56)
    theirs = [rng.randrange(VOCAB) for _ in range(6 * PAGE)]
    mine = theirs[:10] + [(t + 1) % VOCAB for t in theirs[10:]]
    follower = _follower(mine)
    eng.admission._followed(follower, _l3_read(theirs, 0, 4 * PAGE))
    assert follower.promoted_tokens == 2 * PAGE


def test_a_follower_keeps_what_its_own_prefetch_promoted_when_the_read_it_followed_promoted_less():
    """A request whose own prefetch promoted 4 pages, then followed another's read that promoted 2 pages of its
    prefix, still scores those 4 pages as L3 hits: following never lowers what was read from L3 for it."""
    eng = make_engine()
    rng = random.Random(57)
    prompt = [rng.randrange(VOCAB) for _ in range(6 * PAGE)]
    follower = _follower(prompt, promoted=4 * PAGE)
    eng.admission._followed(follower, _l3_read(prompt, 0, 2 * PAGE))
    assert follower.promoted_tokens == 4 * PAGE


def test_a_follower_of_a_read_that_landed_in_l2_without_l1_room_scores_it_as_l3():
    """A read that brought the pages to L2 but whose H2D found no L1 room ended unsuccessful; its pages are in L2
    all the same, so its follower scores what it promoted as L3 hits (a read that failed outright promotes
    nothing)."""
    eng = make_engine()
    rng = random.Random(58)
    prompt = [rng.randrange(VOCAB) for _ in range(6 * PAGE)]
    lost, failed = _follower(prompt), _follower(prompt)
    eng.admission._followed(lost, _l3_read(prompt, PAGE, 5 * PAGE, succeeded=False, l1_room_lost=True))
    eng.admission._followed(failed, _l3_read(prompt, PAGE, 5 * PAGE, succeeded=False))
    assert (lost.promoted_tokens, failed.promoted_tokens) == (4 * PAGE, 0)


# -- fallbacks --------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_failed_prefetch_whose_request_recomputes_its_prefix_is_a_fallback():
    """A prefetch whose L3 read fails (EIO) leaves its request to compute the prefix L3 held: that counts as one
    fallback in the metrics (the request's output is the one a cache-less engine gives)."""
    rng = random.Random(59)
    prefix = [rng.randrange(VOCAB) for _ in range(24)]
    faults = FaultInjector()
    eng = make_engine(faults=faults)
    await eng.start()
    await prefix_in_l3(eng, prefix)
    before = eng.metrics()["fallbacks"]
    faults.arm(Fault.EIO_READ, times=1)
    [out] = await eng.generate_async([prefix + [9]], SamplingParams(max_tokens=3))
    await eng.cache.drain()
    assert out.output_ids == (await reference([prefix + [9]], 3))[0]
    assert out.cached_tokens == {"l1": 0, "l2": 0, "l3": 0}  # (the premise: it recomputed the prefix)
    m = eng.metrics()
    assert m["failures"] == {"eio": 1} and m["fallbacks"] - before == 1
    await finish(eng)

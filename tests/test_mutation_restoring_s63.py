"""Restoring rules left unpinned by session 63's mutation check of scheduler/restoring.py. The referee as in
tests/test_restore_bookkeeping_hunt.py: greedy outputs equal a no-cache engine's, every tier whole after the engine
drained."""
from __future__ import annotations

import asyncio
import random

import pytest

from hicache.radix import Tier
from hicache_helpers import finish, until
from scheduler.request import SamplingParams
from test_followups_hunt import reference
from test_restore_bookkeeping_hunt import PAGE, VOCAB, make_engine, prefix_in_l3, results


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


async def _l2_head_l3_whole(eng, prefix: list[int], head_tokens: int) -> None:
    """`prefix` in L3 whole, in L2 up to `head_tokens` (read back by a request of the head alone), in L1 nowhere."""
    await prefix_in_l3(eng, prefix)
    await eng.generate_async([prefix[:head_tokens] + [1]], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    assert eng.cache.tree.match(prefix, touch=False).lengths == [0, head_tokens, len(prefix)]


# -- a request queued outside a running loop prefetches once one runs it (R1) ------------------------------------
def test_a_request_queued_outside_a_loop_starts_its_prefetch_on_the_loops_first_plan():
    """add_request outside a running loop cannot start the prefetch's driver: the request is marked, and the loop
    that later runs it starts that prefetch before admission (`start_deferred_hints`), so its prefix is promoted
    by a prefetch (counted as one) rather than read by a restore at admission."""
    rng = random.Random(6301)
    prefix = _prompt(rng, 6 * PAGE)
    eng = make_engine(restore_overlap=False)

    async def warm():
        await eng.start()
        await prefix_in_l3(eng, prefix)
        await eng.stop_loop()
    asyncio.run(warm())
    started = eng.cache.metrics.prefetches_started
    req = eng.add_request(prefix + [2], SamplingParams(max_tokens=3))  # no loop runs here
    assert req.prefetch_op is None and req.hint_deferred

    async def run():
        await eng.start()
        [out] = await results([req])
        assert out.output_ids == (await reference([prefix + [2]], 3))[0]
        assert out.cached_tokens == {"l1": 0, "l2": 0, "l3": len(prefix)}
        assert eng.cache.metrics.prefetches_started == started + 1
        assert not req.hint_deferred
        await finish(eng)
    asyncio.run(run())


# -- a prefetch above an L2 head: what it promoted, and the plan it priced (R7, R8) ------------------------------
@pytest.mark.asyncio
async def test_a_prefetch_above_an_l2_head_scores_only_what_it_read_as_l3_and_plans_the_tail_after_it(monkeypatch):
    """A prefix L2 holds the first 8 tokens of and L3 all 32: the request's prefetch reads [8, 32) into L2, and the
    request (no overlap: it restores from L2 once the read ended) is counted 8 tokens from L2 and 24 from L3, not
    32 from L3. Running alone, it is scored as L3 by the plan its prefetch was priced with: the tokens left to
    compute past the L3 end (1), not past the L2 head."""
    rng = random.Random(6302)
    prefix = _prompt(rng, 8 * PAGE)
    eng = make_engine(restore_overlap=False)
    await eng.start()
    await _l2_head_l3_whole(eng, prefix, 2 * PAGE)
    scored = []
    monkeypatch.setattr(eng.cache, "observe_outcome", lambda source, plan, actual_s: scored.append((source, plan)))
    [out] = await eng.generate_async([prefix + [3]], SamplingParams(max_tokens=3))
    assert out.output_ids == (await reference([prefix + [3]], 3))[0]
    assert eng.cache.metrics.prefetches_started >= 1
    assert out.cached_tokens == {"l1": 0, "l2": 8, "l3": 24}, out.cached_tokens
    [(source, (priced, uncached))] = scored
    assert source == "l3" and uncached == 1 and priced[:3] == (0, 8, 32), scored
    await finish(eng)


# -- a prefetch queued beside a running request is priced without a take-on (R9) ---------------------------------
@pytest.mark.asyncio
async def test_a_prefetch_queued_beside_a_running_request_is_priced_without_a_take_on():
    """A prefetch credits its H2D as hidden under the tail's forward (`l3_taken_on`) only for a request that
    would run alone: queued while another request decodes, its plan is priced with no overlap and no take-on."""
    rng = random.Random(6303)
    prefix = _prompt(rng, 6 * PAGE)
    eng = make_engine()
    await eng.start()
    await prefix_in_l3(eng, prefix)
    busy = eng.add_request(_prompt(rng, 10), SamplingParams(max_tokens=200, ignore_eos=True))
    await until(lambda: busy.output, 60)
    req = eng.add_request(prefix + [3], SamplingParams(max_tokens=2))
    assert req.prefetch_op is not None
    priced, uncached = req.span_plan["l3"]
    assert priced == (0, 0, len(prefix), False, False) and uncached == 1, req.span_plan
    await eng.abort(busy.rid)
    [out] = await results([req])
    assert out.output_ids == (await reference([prefix + [3]], 2))[0]
    await finish(eng)


# -- a request whose prefetch it did not use is not scored (R20) -------------------------------------------------
@pytest.mark.asyncio
async def test_a_request_that_recomputed_what_its_prefetch_promoted_is_not_scored(monkeypatch):
    """Its prefetch was priced as an L3 path (the plan at queue time); at admission the cost model declined the L2
    restore of what it promoted and the request recomputed the prefix: its path changed on the way, so its time to
    the first token is a sample of neither source (not of L1's, which its plan also names)."""
    from dataclasses import replace
    rng = random.Random(6304)
    prefix = _prompt(rng, 6 * PAGE)
    eng = make_engine(restore_overlap=False)
    await eng.start()
    await prefix_in_l3(eng, prefix)
    decide = eng.cache.decide

    def recompute_at_admission(m, *args, **kwargs):
        decision = decide(m, *args, **kwargs)
        return decision if kwargs.get("lookahead") else replace(decision, tier="l1", restore_tokens=0)
    monkeypatch.setattr(eng.cache, "decide", recompute_at_admission)
    scored = []
    monkeypatch.setattr(eng.cache, "observe_outcome", lambda source, plan, actual_s: scored.append((source, plan)))
    req = eng.add_request(prefix + [3], SamplingParams(max_tokens=2))
    assert req.prefetch_op is not None and set(req.span_plan) == {"l3"}
    [out] = await results([req])
    assert out.output_ids == (await reference([prefix + [3]], 2))[0]
    assert out.cached_tokens == {"l1": 0, "l2": 0, "l3": 0} and set(req.span_plan) == {"l3", "l1"}
    assert scored == []
    await finish(eng)


# -- the L1 room a parked prefetch keeps is what is left, at most (R37) ------------------------------------------
@pytest.mark.asyncio
async def test_a_parked_read_keeps_no_more_l1_room_than_is_left():
    """`_read_room_pages`: a request parked on its prefetch keeps L1 room for the read's H2D up to what it needs,
    but only out of what is free: with 4 pages left and 8 needed it keeps 4 (more would drive the room others are
    admitted on below zero)."""
    from scheduler.request import Request
    rng = random.Random(6305)
    prefix = _prompt(rng, 8 * PAGE)
    eng = make_engine(num_pages=16)
    await eng.start()
    await prefix_in_l3(eng, prefix)
    req = Request(prompt=prefix + [3], params=SamplingParams(max_tokens=2))
    assert eng.admission._read_room_pages(req, len(prefix)) == 8
    claim = eng.cache.new_claim("squatter")
    assert eng.cache.alloc_l1(eng.cache.available_l1_pages() - 4, claim) is not None
    assert eng.admission._read_room_pages(req, len(prefix)) == 4
    eng.cache.release_claim(claim)
    await finish(eng)


# -- an L2 restore is priced as overlapped only where its tail's pages fit too (R39) ------------------------------
@pytest.mark.asyncio
async def test_an_l2_restore_whose_tail_pages_do_not_fit_now_is_priced_whole():
    """A request alone, its prefix (8 pages) in L2: the restore fits the L1 room (20 pages) but the restore and
    the 15 pages its tail and decode reserve do not, so it cannot overlap: it is priced (and parked) with its H2D
    whole, not credited as hidden under the tail's forward."""
    rng = random.Random(6306)
    prefix = _prompt(rng, 8 * PAGE)
    eng = make_engine(num_pages=32, decode_reserve_ratio=1.0)
    await eng.start()
    await prefix_in_l3(eng, prefix, l2_too=True)
    claim = eng.cache.new_claim("squatter")
    assert eng.cache.alloc_l1(eng.cache.available_l1_pages() - 20, claim) is not None
    req = eng.add_request(prefix + [3], SamplingParams(max_tokens=56, ignore_eos=True))
    await until(lambda: "l2" in (req.span_plan or {}) or req.state.done, 60)
    priced, uncached = req.span_plan["l2"]
    assert priced == (0, len(prefix), len(prefix), False, False) and uncached == 1, req.span_plan
    eng.cache.release_claim(claim)
    eng.wake_soon()  # (the loop sleeps while its queue waits for memory: the squatter is no request)
    [out] = await results([req])
    assert out.output_ids == (await reference([prefix + [3]], 56))[0]
    assert out.cached_tokens == {"l1": 0, "l2": len(prefix), "l3": 0}
    await finish(eng)


# -- an L2 restore of a longer L3 hit ends at L2 (R41) -----------------------------------------------------------
@pytest.mark.asyncio
async def test_an_l2_restore_of_a_longer_l3_hit_plans_the_tokens_past_l2_as_computed(monkeypatch):
    """L2 holds 8 tokens of the prefix, L3 all 32, and the cost model picks L2: the restore brings 8 tokens and the
    forward computes the rest, so the plan it is scored by counts 25 tokens to compute (not the 1 past L3's end;
    regression: the gap was learned as the L2 source's overhead)."""
    from dataclasses import replace
    rng = random.Random(6307)
    prefix = _prompt(rng, 8 * PAGE)
    eng = make_engine(restore_overlap=False)
    await eng.start()
    await _l2_head_l3_whole(eng, prefix, 2 * PAGE)
    decide = eng.cache.decide

    def prefer_l2(m, *args, **kwargs):
        decision = decide(m, *args, **kwargs)
        l1, l2, _ = m.lengths
        return replace(decision, tier="l2", restore_tokens=l2 - l1) if decision.tier == "l3" else decision
    monkeypatch.setattr(eng.cache, "decide", prefer_l2)
    scored = []
    monkeypatch.setattr(eng.cache, "observe_outcome", lambda source, plan, actual_s: scored.append((source, plan)))
    [out] = await eng.generate_async([prefix + [3]], SamplingParams(max_tokens=2))
    assert out.output_ids == (await reference([prefix + [3]], 2))[0]
    assert out.cached_tokens == {"l1": 0, "l2": 8, "l3": 0}, out.cached_tokens
    [(source, (priced, uncached))] = scored
    assert source == "l2" and uncached == len(prefix) + 1 - 8, scored
    await finish(eng)

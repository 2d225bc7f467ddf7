"""Restoring rules left unpinned by session 64's mutation check of scheduler/restoring.py (the survivors of session
63's, run against every test that reaches the changed code). The referee as in tests/test_cancel_hunt.py and
tests/test_restore_overlap.py: greedy outputs equal a no-cache engine's, every tier whole after the engine drained."""
from __future__ import annotations

import pytest

from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import ReadGate, until
from scheduler.request import RequestState, SamplingParams
from test_cancel_hunt import FIRST, OTHER, PARAMS, PREFIX, SECOND, assert_idle_and_empty, prefix_only_in_l3
from test_cancel_hunt import make_engine as make_cancel_engine
from test_cancel_hunt import reference as cancel_reference
from test_faults import PROMPT, REUSABLE, finish, make_engine, only_in_l3, reference, run_one
from test_restore_bookkeeping_hunt import make_engine as make_reserving_engine
from test_restore_bookkeeping_hunt import prefix_in_l3, results
from test_followups_hunt import reference as batch_reference


# -- a read is kept for a queued request only if that request will use its first page (R15) ----------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("queued_len", [1, 0], ids=["one_past_the_page", "the_page_only"])
async def test_an_aborted_requests_read_is_kept_only_for_a_queued_request_that_uses_its_first_page(queued_len):
    """FIRST's prefetch reads the prefix from L3; a request queued behind a running one shares the read's first page.
    FIRST is aborted: the read goes on for the queued request if that request's prompt runs past the page (it will
    read the page, `_op_wanted`); a prompt of exactly that page reuses none of it (its last token is computed, so
    its reusable prefix ends one short of the page): no one waits for the read, which is cancelled."""
    eng = make_cancel_engine(max_running_requests=1)
    await eng.start()
    await prefix_only_in_l3(eng)
    page = eng.config.page_size
    gate = ReadGate(eng.cache.store)
    busy = eng.add_request(OTHER, SamplingParams(max_tokens=64, ignore_eos=True))
    await until(lambda: busy.state is RequestState.DECODE)
    first = eng.add_request(FIRST, PARAMS)
    read = first.prefetch_op
    assert read is not None and read.payload["l2_start"] == 0
    queued = eng.add_request(PREFIX[: page + queued_len], PARAMS)
    assert await eng.abort(first.rid)
    await until(lambda: first.state.done)
    assert bool(read.payload.get("cancel")) is (queued_len == 0)
    gate.release()
    await eng.abort(busy.rid)
    [out] = await results([queued])
    assert out.output_ids == await cancel_reference(PREFIX[: page + queued_len])
    await until(lambda: read.done)
    assert (read.state is OpState.CANCELLED) is (queued_len == 0)
    assert eng.metrics()["cancellations"] == int(queued_len == 0)
    await assert_idle_and_empty(eng)
    await eng.shutdown()


# -- a landed prefetch is taken on only where the tail's pages fit too (R53) -------------------------------------
@pytest.mark.asyncio
async def test_a_landed_prefetch_is_not_taken_on_where_the_requests_later_pages_do_not_fit(monkeypatch):
    """A request alone, its prefix (6 pages) read from L3 by its prefetch, landed with its checksums held for a
    take-on. The L1 room (11 pages) fits the take-on's H2D but not the 10 pages its tail and decode reserve after
    it (decode_reserve_ratio 1): it is not taken on (`_take_on`: every page reserved now), and the request is
    served once the room is back, its output a recompute's. (Counting only the offers while the room is short.)"""
    import hicache.restores as restores_mod
    monkeypatch.setattr(restores_mod, "HOLD_CHECKS_MAX_S", 3600.0)
    eng = make_reserving_engine(num_pages=48, decode_reserve_ratio=1.0)
    await eng.start()
    await run_one(eng)
    eng.cache.runner.start_backup(PROMPT[:REUSABLE])
    await eng.cache.drain()
    only_in_l3(eng, PROMPT[:REUSABLE])
    await eng.stop_loop()
    req = eng.add_request(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    op = req.prefetch_op
    assert op is not None and op.payload["read"]._start_held is not None  # held for a take-on
    await until(lambda: op.state is OpState.S2H_LANDED)
    adm = eng.admission
    assert adm._pages_after(req, REUSABLE) == 10
    claim = eng.cache.new_claim("squatter")
    assert eng.cache.alloc_l1(eng.cache.available_l1_pages() - 11, claim) is not None
    taken, take = [], adm._take_landed  # (what each offer while the room is short did)

    def spy(r, alone, budget):
        took = take(r, alone, budget)
        if claim is not None:
            taken.append(took)
        return took
    monkeypatch.setattr(adm, "_take_landed", spy)
    await eng.start()
    await until(lambda: taken, 30)
    eng.cache.release_claim(claim)
    claim = None  # (offered again now, it may take the read on: every page fits)
    eng.wake_soon()
    [out] = await results([req])
    assert taken and not any(taken), taken
    assert out.output_ids == await reference(PROMPT, 40)
    await finish(eng)


# -- a forward whose layer wait gave up is rerun also where its restore had ended (R59) ---------------------------
@pytest.mark.asyncio
async def test_a_forward_whose_layer_wait_gave_up_is_rerun_also_when_its_restore_ended_first():
    """The overlapped restore ended (and published) before its forward's output was looked at, but that forward's
    layer wait gave up: its output is still dropped (it may have read K/V that had not landed) and the tail runs
    again on the restored pages (tests/test_restore_overlap.py has the case of a restore still landing)."""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    await run_one(eng)
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    gave_up = iter([True])
    eng.runner.restore_wait_timed_out = lambda: next(gave_up, False)
    collect = eng.runner.collect

    async def collect_once_the_restore_ended(handle):
        ids = await collect(handle)
        for r in list(eng.running):
            if r.overlap_op is not None:
                await eng.cache.runner.wait_op(r.overlap_op)
                assert r.overlap_op.done
        return ids
    eng.runner.collect = collect_once_the_restore_ended
    batches = eng.stats["batches"]
    result = await run_one(eng)
    assert result.output_ids == want
    assert eng.stats["restore_overlaps"] == 1 and result.cached_tokens["l2"] == REUSABLE
    assert eng.stats["restore_waits_timed_out"] == 1
    assert eng.stats["batches"] - batches == 1 + len(want)  # the discarded tail, its rerun, decode
    await finish(eng)


# -- a prefetch taken on above an L2 head counts that head as L2 (R55) -------------------------------------------
@pytest.mark.asyncio
async def test_a_prefetch_taken_on_above_an_l2_head_counts_only_what_it_read_as_l3():
    """L2 holds the first 8 tokens of a 32-token prefix, L3 all of it: the request's prefetch reads [8, 32) and,
    the request alone, is taken on to L1 under its tail's forward (`_take_on`). It is counted 8 tokens from L2
    and 24 from L3, not 32 from L3 (as the same prefetch is without a take-on)."""
    import random
    rng = random.Random(6401)
    page = 4
    prefix = [rng.randrange(512) for _ in range(8 * page)]
    eng = make_reserving_engine()
    await eng.start()
    await prefix_in_l3(eng, prefix)
    await eng.generate_async([prefix[:2 * page] + [1]], SamplingParams(max_tokens=1))  # the head back into L2
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    assert eng.cache.tree.match(prefix, touch=False).lengths == [0, 2 * page, len(prefix)]
    overlaps = eng.stats["restore_overlaps"]
    [out] = await eng.generate_async([prefix + [3]], SamplingParams(max_tokens=3))
    assert eng.stats["restore_overlaps"] == overlaps + 1  # taken on
    assert out.output_ids == (await batch_reference([prefix + [3]], 3))[0]
    assert out.cached_tokens == {"l1": 0, "l2": 2 * page, "l3": 6 * page}, out.cached_tokens
    await finish(eng)


# -- a request that waited for another's read is not scored (R31) ----------------------------------------------
@pytest.mark.asyncio
async def test_a_request_that_followed_an_aborted_requests_read_is_scored_as_l3_but_teaches_the_cost_model_nothing(
        monkeypatch):
    """SECOND waits for FIRST's prefetch read (`follow_op`); FIRST is aborted, the read goes on for SECOND, which
    then restores what it promoted from L2 and runs alone: its hit counts as L3 (`_followed`), but its time to the
    first token includes a wait priced in no plan of its own, so it is no sample of what its source costs."""
    eng = make_cancel_engine()
    await eng.start()
    await prefix_only_in_l3(eng)
    gate = ReadGate(eng.cache.store)
    scored = []
    monkeypatch.setattr(eng.cache, "observe_outcome", lambda source, plan, actual_s: scored.append((source, plan)))
    first = eng.add_request(FIRST, PARAMS)
    second = eng.add_request(SECOND, PARAMS)
    await until(lambda: second.follow_op is first.prefetch_op is not None)
    assert await eng.abort(first.rid)
    await until(lambda: first.state.done)
    gate.release()
    [out] = await results([second])
    assert out.output_ids == await cancel_reference(SECOND)
    assert out.cached_tokens == {"l1": 0, "l2": 0, "l3": len(PREFIX)}, out.cached_tokens
    assert scored == [], scored
    await assert_idle_and_empty(eng)
    await eng.shutdown()


# -- a request parked on an L2 restore keeps no extra L1 room (R47) ---------------------------------------------
@pytest.mark.asyncio
async def test_a_request_parked_on_an_l2_restore_keeps_no_l1_room_beside_the_pages_the_restore_took():
    """An L2 restore allocates its L1 pages as it starts: its request, parked until the copy ends, keeps no room
    for them besides (`_park` keeps room only for an L3 read's H2D, still to allocate); keeping it would count
    those pages twice against the requests admitted meanwhile."""
    import random
    from test_faults import TransferGate
    rng = random.Random(6402)
    prefix = [rng.randrange(512) for _ in range(6 * 4)]
    eng = make_reserving_engine(restore_overlap=False)
    await eng.start()
    await prefix_in_l3(eng, prefix, l2_too=True)
    gate = TransferGate(eng, "h2d")
    req = eng.add_request(prefix + [3], PARAMS)
    await until(lambda: req.state is RequestState.PARKED)
    assert req.restore_op is not None and req.restore_tier == "l2"
    assert req.reserved_pages == 0 and eng.admission.reserved_pages == 0
    gate.release.set()
    [out] = await results([req])
    assert out.output_ids == (await batch_reference([prefix + [3]], PARAMS.max_tokens))[0]
    assert out.cached_tokens == {"l1": 0, "l2": len(prefix), "l3": 0}
    await finish(eng)

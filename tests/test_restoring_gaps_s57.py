"""Restoring rules found untested by session 57's mutation check of scheduler/restoring.py: a request decided to
restore from L2 does not wait for another request's storage read of an overlapping prefix; a request whose
restores could not start counts one fallback for the longest of them when it then computes that prefix; a request
that waited on another's read that failed is no sample of its prefix source's cost (a bug until session 57). The
referee as in tests/test_restore_bookkeeping_hunt.py: greedy outputs equal a no-cache engine's, every tier whole
after the engine drained."""
from __future__ import annotations

import random

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpKind
from hicache.radix import Tier
from hicache_helpers import finish, until
from scheduler.request import RequestState, SamplingParams
from test_followups_hunt import reference
from test_restore_bookkeeping_hunt import PAGE, VOCAB, HeldReads, make_engine, prefix_in_l3, results


# -- an L2 restore follows only an L2 restore in flight -------------------------------------------
@pytest.mark.asyncio
async def test_a_request_restoring_from_l2_does_not_wait_for_another_requests_storage_read():
    """A request whose prefix L2 holds is restored from L2 at once, even while another request's L3 read of a
    prefix sharing its first pages is still in flight: it does not park behind that slower read (deciding for L2
    declined a storage read), and its hit counts as L2, not as pages the read brought.

    Both prompts share an 8-token head S; A's 32-token prefix (S + 24 tokens) is in L2 only up to S and wholly in
    L3, so A restores from L3 (a RESTORE_L3 started at admission; its read held). B's 32-token prefix (S + 24
    other tokens) is wholly in L2 (and L3): B decides for L2."""
    rng = random.Random(5701)
    head = [rng.randrange(VOCAB) for _ in range(2 * PAGE)]
    a_prefix = head + [rng.randrange(VOCAB) for _ in range(6 * PAGE)]
    b_prefix = head + [rng.randrange(VOCAB) for _ in range(6 * PAGE)]
    eng = make_engine()
    await eng.start()
    for prefix in (a_prefix, b_prefix):  # computed once each, backed up to L2 and L3
        await eng.generate_async([prefix + [1]], SamplingParams(max_tokens=1))
        await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    tree = eng.cache.tree
    assert [tree.match(p, touch=False).lengths for p in (a_prefix, b_prefix)] == [[0, 32, 32]] * 2
    gate = HeldReads(eng.cache.store)
    a = eng.add_request(a_prefix + [3], SamplingParams(max_tokens=3))
    assert a.prefetch_op is None  # (queued while L2 held it all: nothing to promote)
    # L2 loses A's own 24 tokens (S stays, B's pages stay) before A is admitted: a RESTORE_L3 at admission
    a_leaf = tree.match(a_prefix, touch=False).handles[Tier.L2]
    tree.evict(Tier.L2, 6, keep=lambda node: node is not a_leaf)
    assert tree.match(a_prefix, touch=False).lengths == [0, 8, 32]
    assert tree.match(b_prefix, touch=False).lengths == [0, 32, 32]
    await until(lambda: a.state is RequestState.PARKED, 60)
    assert a.restore_op is not None and a.restore_op.kind is OpKind.RESTORE_L3  # (the premise: its read held)
    b = eng.add_request(b_prefix + [4], SamplingParams(max_tokens=3))
    assert b.prefetch_op is None
    await until(lambda: b.state.done or b.follow_op is not None, 60)
    assert b.follow_op is None, "B parked behind A's storage read instead of restoring from L2"
    assert a.state is RequestState.PARKED and not a.restore_op.done  # (A's read still held meanwhile)
    [b_out] = await results([b])
    assert b_out.output_ids == (await reference([b.prompt], 3))[0]
    assert b_out.cached_tokens == {"l1": 0, "l2": 32, "l3": 0}, b_out.cached_tokens
    gate.release()
    [a_out] = await results([a])
    assert a_out.output_ids == (await reference([a.prompt], 3))[0]
    assert a_out.cached_tokens == {"l1": 0, "l2": 8, "l3": 24}, a_out.cached_tokens
    assert eng.metrics()["failures"] == {}
    await finish(eng)



# -- a fallback counts the longest prefix a failed restore of the request's was to bring ----------
@pytest.mark.asyncio
async def test_a_fallback_counts_the_longest_restore_that_could_not_start_not_the_last():
    """A request whose L3 restore could not start (L2 had no page for its read) and which waited for L1 room
    tried again on later turns; by then L3 had lost the prefix's last pages, so the next restore aimed shorter and
    could not start either. When it is finally admitted, L1 holds the prefix up to where that shorter restore
    ended (another restore brought it), and the request computes the rest, which its first restore was to bring:
    that is a fallback in the metrics (a shorter attempt later does not forget the longer one).

    The loop is stopped and admission turns are run one by one (`Admission._admit`, as the loop's prefill pass
    calls it), the tiers changed between turns as the loop's other work would change them: L2 and L1 are taken
    by claims of the test's (L2 wholly: no read can start; L1 all but 10 pages: the restore's 8 fit, the
    request's 12 do not), L3 evicts the prefix's last node (8 tokens), a restore of the first 24 tokens lands."""
    rng = random.Random(5703)
    prefix = [rng.randrange(VOCAB) for _ in range(8 * PAGE)]
    prompt = prefix + [5]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eng = make_engine(decode_reserve_ratio=1.0)
    cache, adm, tree = eng.cache, eng.admission, eng.cache.tree
    await eng.start()
    for head in (prefix[:6 * PAGE], prefix):  # two nodes: [0, 24) and [24, 32)
        await eng.generate_async([head + [1]], SamplingParams(max_tokens=1))
        await eng.cache.drain()
    await eng.stop_loop()
    cache.flush(Tier.L1)
    cache.flush(Tier.L2)
    assert tree.match(prefix, touch=False).lengths == [0, 0, 32]
    before = eng.metrics()["fallbacks"]
    l2_squat = cache.new_claim("squatter", Tier.L2)
    assert cache.alloc_pages(Tier.L2, cache.l2.allocator.num_free, l2_squat)
    l1_squat = cache.new_claim("squatter")
    assert cache.alloc_pages(Tier.L1, cache.l1.allocator.num_free - 10, l1_squat)
    req = eng.add_request(prompt, params)
    assert req.prefetch_op is None  # (no L2 page for a prefetch's read either)
    refused = []
    start_restore = cache.runner.start_restore

    def spy(tokens, m, tier, rid, **kw):
        op = start_restore(tokens, m, tier, rid, **kw)
        if op is None:
            refused.append((tier, m.lengths[Tier.L3]))
        return op
    cache.runner.start_restore = spy
    assert adm._pages_after(req, 0) == 12
    assert await adm._admit(req) is False  # turn 1: a 32-token L3 restore could not start; no L1 room
    tree.evict(Tier.L3, 2)  # L3 evicts the prefix's last node
    assert tree.match(prefix, touch=False).lengths == [0, 0, 24]
    assert await adm._admit(req) is False  # turn 2: a 24-token L3 restore could not start either
    assert refused == [("l3", 32), ("l3", 24)]  # (the premise)
    cache.runner.start_restore = start_restore
    cache.release_claim(l2_squat, Tier.L2)
    m = tree.match(prefix[:6 * PAGE], touch=False)
    op = cache.runner.start_restore(prefix[:6 * PAGE], m, "l3", None)  # another restore brings the first 24
    assert op is not None
    await cache.runner.wait_op(op)
    assert op.succeeded and tree.match(prefix, touch=False).lengths == [24, 24, 24]
    cache.release_claim(l1_squat)
    assert await adm._admit(req) is True  # turn 3: admitted on its L1 hit, computing [24, 32) and the tail
    assert eng.metrics()["fallbacks"] - before == 1
    await eng.start()
    [out] = await results([req])
    assert out.output_ids == (await reference([prompt], params.max_tokens))[0]
    assert out.cached_tokens == {"l1": 24, "l2": 0, "l3": 0}, out.cached_tokens
    await finish(eng)


# -- a follower of a failed read is not scored ------------------------------------------------------
@pytest.mark.asyncio
async def test_a_request_that_waited_on_a_failed_read_teaches_the_cost_model_nothing():
    """A request parked behind another request's L3 read (`follow_op`) that then fails has waited for nothing its
    own source costs: once it gets its prefix alone (here it reads L3 itself after the leader is aborted), its
    arrival-to-first-token time, the failed read's timeout included, is no outcome of L3 (nor of a recompute).
    Regression: `_unpark` kept a follower's plan on a failed op, and the cost model learned an L3 outcome ~0.3 s
    over its price from one timed-out read."""
    rng = random.Random(5702)
    prefix = [rng.randrange(VOCAB) for _ in range(6 * PAGE)]
    faults = FaultInjector()
    eng = make_engine(faults=faults, policy="cost", storage_explore_reads=4, io_timeout_s=0.3)
    await eng.start()
    await prefix_in_l3(eng, prefix)
    scored = []
    observe = eng.cache.observe_outcome

    def spy(source, plan, actual_s):
        scored.append((source, round(actual_s, 3)))
        observe(source, plan, actual_s)
    eng.cache.observe_outcome = spy
    faults.arm(Fault.SLOW_READ, delay_s=1.0)  # the leader's prefetch: past its deadline
    leader = eng.add_request(prefix + [3], SamplingParams(max_tokens=3))
    assert leader.prefetch_op is not None
    follower = eng.add_request(prefix + [4, 5], SamplingParams(max_tokens=3))
    await until(lambda: follower.follow_op is leader.prefetch_op and leader.state is RequestState.PARKED, 60)
    await eng.abort(leader.rid)  # (its read is kept for the follower)
    [out] = await results([follower])
    assert out.output_ids == (await reference([follower.prompt], 3))[0]
    assert eng.metrics()["failures"] == {"timeout": 1}
    assert out.cached_tokens == {"l1": 0, "l2": 0, "l3": 24}
    assert scored == [], f"the follower's wait for the failed read was scored (source, arrival to 1st token): {scored}"
    await finish(eng)

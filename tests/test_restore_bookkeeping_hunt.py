"""Restore bookkeeping left open by earlier hunts (session 29): the L1 room a parked L3 read will need,
the queue order of requests that park again, what `fallbacks` counts, and which tier a follower's
hit is counted from. The referee as in tests/test_followups_hunt.py: greedy outputs equal a no-cache
engine's, and after the engine drained every tier is whole (integrity, nothing private, no lock left)."""
from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.ops import OpKind
from hicache.radix import Tier
from hicache_helpers import ReadGate, capture_op_logs, finish, until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import Request, RequestState, SamplingParams
from test_followups_hunt import D2HGate, reference

VOCAB = 512
PAGE = 4


class HeldReads(ReadGate):
    """ReadGate (the store's L3 reads held until `release()`) whose reads also start their checksums
    once released: a prefetch expected to be taken on opens its read with held checksums
    (`hold_checks`), started through the read's own future, which the gate's plain one hides."""

    def released(self, inner) -> None:
        getattr(inner, "start_checks", lambda: None)()


def make_engine(num_pages: int = 64, faults: FaultInjector | None = None, restore_overlap: bool = True,
                decode_reserve_ratio: float | str = "auto", **hicache) -> Engine:
    hicache.setdefault("transfer_backend", "torch")
    hicache.setdefault("policy", "always")
    hicache.setdefault("host_ratio", 2.0)
    hicache.setdefault("storage_ratio", 4.0)
    config = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=PAGE,
                          restore_overlap=restore_overlap, decode_reserve_ratio=decode_reserve_ratio)
    return Engine(config.with_hicache(enable=True, **hicache), faults=faults or FaultInjector())


async def prefix_in_l3(eng: Engine, prefix: list[int], l2_too: bool = False) -> None:
    """Compute `prefix` once and drop it from L1 and L2 (l2_too: read it back into L2 as well)."""
    await eng.generate_async([prefix + [1]], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    eng.cache.flush(Tier.L2)
    if l2_too:  # L3 -> L2 -> L1, then L1 loses it again
        [warm] = await eng.generate_async([prefix + [2]], SamplingParams(max_tokens=1))
        assert warm.cached_tokens["l3"] == len(prefix)
        await eng.cache.drain()
        eng.cache.flush(Tier.L1)
    held = [0, len(prefix), len(prefix)] if l2_too else [0, 0, len(prefix)]
    assert eng.cache.tree.match(prefix, touch=False).lengths == held


async def results(reqs: list[Request]):
    for req in reqs:
        while not req.state.done:
            if (await req.queue.get()).finished:
                break
    return [req.result() for req in reqs]


def admission_order(logs: list[dict]) -> list[str]:
    return [e["rid"] for e in logs if e.get("event") == "request" and e["state"] == "prefill_start"]


# -- 1. a parked L3 read keeps the L1 room its H2D will need --------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("read", ["restore", "prefetch"])
async def test_a_parked_l3_read_keeps_the_l1_room_its_h2d_needs(read):
    """Regression: a request parked while its prefix was read from L3 (a RESTORE_L3 started at
    admission, or its own prefetch) reserved none of the L1 pages its H2D would need, so requests
    queued after it were admitted on that room meanwhile: the RESTORE_L3's H2D then found none
    (`no_pages`, the l1_room_lost retry), and a prefetch's request waited for them all to finish.
    Now the parked read keeps its room (Admission.reserved_pages): a later request is admitted only
    on what is left, and the restore lands with no failure.

    L1 32 pages: the read needs 8; each other request reserves 16 (50 + 15 - 1 tokens), so one of them
    fits beside the read's room, the second must wait (decode_reserve_ratio 1: each reserves all its max_tokens)."""
    rng = random.Random(31)
    prefix = [rng.randrange(VOCAB) for _ in range(32)]
    others = [[rng.randrange(VOCAB) for _ in range(50)] for _ in range(2)]
    eng = make_engine(num_pages=32, decode_reserve_ratio=1.0)
    await eng.start()
    await prefix_in_l3(eng, prefix, l2_too=read == "restore")
    before = eng.metrics()
    gate = HeldReads(eng.cache.store)
    prompts = [prefix + [3]] + others
    params = [SamplingParams(max_tokens=4)] + [SamplingParams(max_tokens=15, ignore_eos=True)] * 2
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    if read == "restore":
        assert reqs[0].prefetch_op is None  # (queued while L2 held it: nothing to promote)
        eng.cache.flush(Tier.L2)  # L2 loses it before the request is admitted: a RESTORE_L3 at admission
    else:
        assert reqs[0].prefetch_op is not None
    await until(lambda: reqs[1].output)  # one later request runs beside the read ...
    parked_on = reqs[0].restore_op or reqs[0].prefetch_op
    assert parked_on.kind is (OpKind.RESTORE_L3 if read == "restore" else OpKind.PREFETCH_L3)
    assert reqs[0].state is RequestState.PARKED
    assert reqs[2].state is RequestState.WAITING  # ... the other would take the read's room
    gate.release()
    out = await results(reqs)
    want = [(await reference([p], sp.max_tokens))[0] for p, sp in zip(prompts, params)]
    assert [r.output_ids for r in out] == want
    after = eng.metrics()
    assert after["failures"] == {} and after["fallbacks"] == 0, after["failures"]
    assert out[0].cached_tokens == {"l1": 0, "l2": 0, "l3": 32}, out[0].cached_tokens
    assert after["directions"]["s2h"]["count"] - before["directions"]["s2h"]["count"] == 1
    assert eng.admission.reserved_pages == 0
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_parked_l3_reads_in_a_small_l1_all_finish_and_leave_every_tier_whole(prefetch, seed):
    """Guard for the room a parked read keeps: an L1 that holds one request and one read at a time,
    L2 smaller than the working set (reads start at admission too), requests with L3 prefixes and
    without arriving together, one aborted while parked. Nothing waits for good (every request
    ends), outputs equal recompute, no reservation outlives its request, every tier is whole."""
    rng = random.Random(100 + seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.choice((16, 24, 32)))] for _ in range(4)]
    eng = make_engine(num_pages=24, prefetch=prefetch, host_ratio=0.5, storage_ratio=8.0)
    await eng.start()
    for prefix in prefixes:
        await eng.generate_async([prefix + [1]], SamplingParams(max_tokens=1))
        await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    eng.cache.flush(Tier.L2)  # every prefix in L3 only: L2 holds what the reads bring
    prompts = [rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
               for _ in range(10)]
    prompts.insert(3, [rng.randrange(VOCAB) for _ in range(40)])
    params = SamplingParams(max_tokens=rng.randrange(2, 12))
    gate = HeldReads(eng.cache.store)
    reqs = [eng.add_request(p, params) for p in prompts]
    await until(lambda: reqs[0].state is RequestState.PARKED)  # on its read, held
    await eng.abort(reqs[0].rid)
    gate.release()
    out = await asyncio.wait_for(results(reqs), 120)
    assert out[0].finish_reason == "abort"
    for p, r in zip(prompts[1:], out[1:]):
        assert r.output_ids == (await reference([p], params.max_tokens))[0]
    assert eng.admission.reserved_pages == 0 and not eng.parked and not eng.waiting
    eng.check_integrity()
    await finish(eng)


# -- 2. requests parked again keep their arrival order -----------------------------------------
@pytest.mark.asyncio
async def test_a_request_parked_again_keeps_its_place_before_later_arrivals():
    """Regression: a request whose prefetch's read landed went back to the queue once (it may take
    the read on to L1, `_take_landed`); not taking it, it parked again, behind the requests that
    arrived after it and were parked on its read meanwhile (followers). When the read ended they
    all went back in parking order: the later arrivals were admitted first, and one of them
    restored the prefix the first one's prefetch had brought. Requests go back in arrival order.

    Three requests share a 32-token prefix only L3 holds; restores are not overlapped (so the first
    does not take its read on) and the read's checksums are slowed, so it is seen landed."""
    rng = random.Random(32)
    prefix = [rng.randrange(VOCAB) for _ in range(32)]
    prompts = [prefix + [2, 3], prefix + [4, 5, 6], prefix + [7]]
    faults = FaultInjector()
    eng = make_engine(faults=faults, restore_overlap=False)
    await eng.start()
    await prefix_in_l3(eng, prefix)
    faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=0.2)
    with capture_op_logs() as logs:
        reqs = [eng.add_request(p, SamplingParams(max_tokens=3)) for p in prompts]
        out = await results(reqs)
    assert [r.output_ids for r in out] == await reference(prompts, 3)
    reparked = [e["rid"] for e in logs if e.get("event") == "request" and e["state"] == "parked"]
    assert reparked.count(reqs[0].rid) >= 2  # (the premise: the first one parked again)
    assert admission_order(logs) == [r.rid for r in reqs]
    # the prefetch's own request restores what it promoted (an L3 hit); the others hit L1
    assert [r.cached_tokens for r in out] == [{"l1": 0, "l2": 0, "l3": 32}] + [{"l1": 32, "l2": 0, "l3": 0}] * 2
    await finish(eng)


def test_requests_back_in_the_queue_keep_their_arrival_order():
    """The same rule wherever a request goes back to the queue: parked requests that end together
    in another order than they arrived (the first parked again after the second), and a request
    whose overlapped restore was discarded (`_rewind`) while one that arrived before it waits."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=PAGE))
    first, second, third = (Request(prompt=[1, 2], params=SamplingParams()) for _ in range(3))
    done = SimpleNamespace(done=True, succeeded=True)
    for req in (second, first):  # the first parked again, after the second
        req.state, req.restore_op = RequestState.PARKED, done
        eng.parked.append(req)
    eng.waiting.append(third)
    eng.admission.settle_parked()
    assert list(eng.waiting) == [first, second, third] and not eng.parked
    eng.waiting.remove(second)
    eng.running.append(second)
    second.state = RequestState.PREFILL
    eng.admission._rewind(second, failed=False)  # (no claim: nothing to release)
    assert list(eng.waiting) == [first, second, third]


# -- 3. fallbacks count requests that recomputed what a tier held --------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("room", ["later", "now"])
async def test_a_restore_that_could_not_start_is_a_fallback_only_if_its_request_recomputes(room):
    """Regression: an L3 restore that could not start (here: every L2 page is the private
    destination of a backup whose copy is in flight) counted a fallback at once, on every tick it
    was tried, although its request, not admissible yet for want of L1 room, waited and was
    restored after all (room "later"). A fallback is counted when its request is admitted to
    compute what the restore was to bring (room "now": admitted at once, it recomputes).

    L1 24 pages, L2 8. A long request X holds L1 (it reserves 20 pages, or 19 with room "now"),
    and its prompt's backup takes 7 L2 pages, its copy held until the restore was refused; the
    restore needs 4 L1 and 4 L2 pages, its request 5 L1 pages."""
    rng = random.Random(33)
    prefix = [rng.randrange(VOCAB) for _ in range(16)]
    x_prompt = [rng.randrange(VOCAB) for _ in range(29)]
    eng = make_engine(num_pages=24, host_ratio=0.34, storage_ratio=8.0, decode_reserve_ratio=1.0)
    assert eng.cache.l2.num_pages == 8
    await eng.start()
    await prefix_in_l3(eng, prefix)
    before = eng.metrics()
    gate = D2HGate(eng)
    x_params = SamplingParams(max_tokens=52 if room == "later" else 48, ignore_eos=True)
    x = eng.add_request(x_prompt, x_params)
    await until(lambda: x.output and eng.cache.runner.live)  # X's backup holds 7 L2 pages
    refused = []
    start_restore = eng.cache.runner.start_restore

    def spy(tokens, m, tier, rid, **kw):
        op = start_restore(tokens, m, tier, rid, **kw)
        if tier == "l3" and op is None:
            refused.append(rid)
            gate.release.set()  # L2 has room again once X's backup copied
        return op
    eng.cache.runner.start_restore = spy
    a = eng.add_request(prefix + [5], SamplingParams(max_tokens=4))
    out = await results([x, a])
    assert refused and set(refused) == {a.rid}  # (the premise: its restore could not start)
    assert [r.output_ids for r in out] == [(await reference([x_prompt], x_params.max_tokens))[0],
                                           (await reference([prefix + [5]], 4))[0]]
    after = eng.metrics()
    assert after["failures"] == {}
    if room == "later":
        assert out[1].cached_tokens == {"l1": 0, "l2": 0, "l3": 16}, out[1].cached_tokens
        assert after["fallbacks"] - before["fallbacks"] == 0
    else:
        assert out[1].cached_tokens == {"l1": 0, "l2": 0, "l3": 0}, out[1].cached_tokens
        assert after["fallbacks"] - before["fallbacks"] == 1
    await finish(eng)


@pytest.mark.asyncio
async def test_a_failed_prefetch_whose_request_reads_l3_itself_is_no_fallback():
    """Regression: a prefetch whose read timed out counted a fallback, although its request then
    read the prefix from L3 itself (a RESTORE_L3 at admission) and recomputed none of it."""
    rng = random.Random(34)
    prefix = [rng.randrange(VOCAB) for _ in range(24)]
    faults = FaultInjector()
    eng = make_engine(faults=faults, io_timeout_s=0.1)
    await eng.start()
    await prefix_in_l3(eng, prefix)
    faults.arm(Fault.SLOW_READ, delay_s=0.4)  # the prefetch's read: past its deadline
    with capture_op_logs() as logs:
        [out] = await eng.generate_async([prefix + [9]], SamplingParams(max_tokens=3))
        await eng.cache.drain()
    assert out.output_ids == (await reference([prefix + [9]], 3))[0]
    ended = {e["kind"]: e["to_state"] for e in logs if e.get("event") == "op" and e["kind"] != "backup"
             and e["to_state"] in ("FAILED", "L1_L2_L3")}
    assert ended == {"prefetch_l3": "FAILED", "restore_l3": "L1_L2_L3"}, ended  # (the premise)
    assert out.cached_tokens == {"l1": 0, "l2": 0, "l3": 24}
    m = eng.metrics()
    assert m["failures"] == {"timeout": 1} and m["fallbacks"] == 0
    await finish(eng)


@pytest.mark.asyncio
async def test_an_l3_restore_whose_h2d_lost_its_room_and_restored_from_l2_is_no_fallback():
    """Regression: an L3 restore whose H2D found no L1 pages (`l1_room_lost`: its read is published
    in L2, its request decides again and restores from there) counted a fallback. The room is taken
    here by a claim of the test's: requests admitted meanwhile no longer can take it."""
    rng = random.Random(35)
    prefix = [rng.randrange(VOCAB) for _ in range(32)]
    eng = make_engine(num_pages=32)
    await eng.start()
    await prefix_in_l3(eng, prefix, l2_too=True)
    gate = HeldReads(eng.cache.store)
    req = eng.add_request(prefix + [3], SamplingParams(max_tokens=4))
    eng.cache.flush(Tier.L2)
    await until(lambda: req.restore_op is not None)
    squatter = eng.cache.new_claim("squatter")
    assert eng.cache.alloc_l1(eng.cache.l1.allocator.num_free, squatter)
    gate.release()
    await until(lambda: eng.metrics()["failures"])
    assert eng.metrics()["failures"] == {"no_pages": 1}  # (the premise: its H2D lost the room)
    eng.cache.release_claim(squatter)
    eng.wake_soon()
    [out] = await results([req])
    assert out.output_ids == (await reference([prefix + [3]], 4))[0]
    assert out.cached_tokens == {"l1": 0, "l2": 0, "l3": 32}
    assert eng.metrics()["fallbacks"] == 0
    await finish(eng)


# -- 4. a follower restoring what another's L3 read promoted counts an L3 hit ---------------------
@pytest.mark.asyncio
async def test_a_follower_restoring_what_a_prefetch_promoted_counts_an_l3_hit():
    """Regression: a request queued while L2 held its prefix (no prefetch), admitted after L2 lost
    it, followed the prefetch of a request queued after it (`follow_op`); the prefetch ended, and
    the follower, first in the queue, restored the promoted pages from L2: its 32 tokens counted as
    an L2 hit, none as L3, although they were read from L3 for it. They count as L3 hits, as they
    do for the prefetch's own request; that request then hits L1."""
    rng = random.Random(36)
    prefix = [rng.randrange(VOCAB) for _ in range(32)]
    eng = make_engine()
    await eng.start()
    await prefix_in_l3(eng, prefix, l2_too=True)
    before = eng.metrics()
    gate = HeldReads(eng.cache.store)
    early = eng.add_request(prefix + [3], SamplingParams(max_tokens=3))
    assert early.prefetch_op is None  # (L2 held it)
    eng.cache.flush(Tier.L2)
    late = eng.add_request(prefix + [4, 5], SamplingParams(max_tokens=3))
    assert late.prefetch_op is not None
    await until(lambda: early.follow_op is late.prefetch_op and late.state is RequestState.PARKED)
    gate.release()
    out = await results([early, late])
    assert [r.output_ids for r in out] == [(await reference([p], 3))[0] for p in (early.prompt, late.prompt)]
    assert [r.cached_tokens for r in out] == [{"l1": 0, "l2": 0, "l3": 32}, {"l1": 32, "l2": 0, "l3": 0}]
    after = eng.metrics()
    hits = {t: after["hit_tokens"][t] - before["hit_tokens"][t] for t in ("l1", "l2", "l3")}
    assert hits == {"l1": 32, "l2": 0, "l3": 32}, hits
    delta = {d: after["directions"][d]["count"] - before["directions"][d]["count"] for d in ("s2h", "h2d")}
    assert delta == {"s2h": 1, "h2d": 1}, delta
    await finish(eng)

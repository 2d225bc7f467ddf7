"""Session 59 hunt (drain59): what the engine's "wait for everything" entry points wait for, per write policy and
tier setup (L2 only; L2 + a file L3; an L1 small enough that eviction happens).

Write-through backups that a step asks for are queued (`OpRunner.backup_soon`) and start two loop hops
later; `generate_async` may return before they started. `cache.drain()` starts them first (`start_due`)
and waits for every driver and settling task, also the backups a waiting one starts when the one it
waited for ends; `stop_loop()` ends the loop, then drains likewise. These tests pin that: afterwards no
operation is live, queued, deferred or settling, every node the policy backs up is in L2 (and L3, under
policy "always"), a follow-up request is served from L2, the tiers are whole and the backup counters
add up. `shutdown()` (no grace, temporary L3) drops the queued backups and cancels those in flight, by
design (docs/design.md "a drain (a cancelling one, shutdown's, drops them)"); its counters add up too.
CPU, tiny preset, page size 4."""
from __future__ import annotations

import random
import threading

import pytest

from hicache.radix import Tier
from hicache_helpers import WriteGate, assert_whole
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

PAGE = 4
VOCAB = 200
_rng = random.Random(59)
BASE = [_rng.randrange(VOCAB) for _ in range(3 * PAGE)]
# six prompts sharing a 3-page head (siblings: their backups wait for one another), tails of 1-11 tokens
PROMPTS = [BASE + [_rng.randrange(VOCAB) for _ in range(_rng.randrange(1, 3 * PAGE))] for _ in range(6)]
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def make_engine(write_policy: str, l3: bool, l1_pages: int) -> Engine:
    config = EngineConfig(model="tiny", device="cpu", num_pages=l1_pages, page_size=PAGE).with_hicache(
        enable=True, transfer_backend="torch", policy="always", write_policy=write_policy,
        host_ratio=4.0, storage_ratio=2.0 if l3 else 0.0)  # (L2 and L3 hold everything: nothing leaves them)
    return Engine(config)


def nothing_in_flight(eng: Engine) -> None:
    runner = eng.cache.runner
    assert not runner.live and not runner._tasks and not runner._settling
    assert not runner._due and not runner._deferred and not runner._backing_up and not runner._l3_writing
    assert runner.pending_counts() == {"backups": 0, "restores": 0, "prefetches": 0, "settling": 0}
    assert eng.cache.pending_ops() == 0


def counters_add_up(eng: Engine) -> None:
    m = eng.cache.metrics
    assert m.backups_started == m.backups_done + sum(m.failures.values()) + m.cancellations, m.as_dict()


def published(eng: Engine) -> list:
    """Every node the tree holds in L1 (not the root)."""
    tree = eng.cache.tree
    return [n for n in tree.iter_nodes() if n is not tree.root and n.pages[Tier.L1] is not None]


async def serve(eng: Engine, rounds: int) -> None:
    for _ in range(rounds):
        outs = await eng.generate_async(PROMPTS, PARAMS)
        assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]


@pytest.mark.asyncio
@pytest.mark.parametrize("entry", ["drain", "stop_loop"])
@pytest.mark.parametrize("l1_pages", [64, 14], ids=["l1_roomy", "l1_evicts"])
@pytest.mark.parametrize("l3", [False, True], ids=["l2", "l2_l3"])
@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
async def test_every_wait_for_everything_lands_what_the_policy_backs_up(write_policy, l3, l1_pages, entry):
    eng = make_engine(write_policy, l3, l1_pages)
    await eng.start()
    await serve(eng, rounds=2)  # (write_through_selective backs up at a prefix's second hit)
    mgr = eng.cache
    if write_policy == "write_through" and l1_pages == 64:
        # the claim under test: generate_async returned with the last step's backups queued, not started
        assert mgr.runner._due, "expected backup_soon's queue to be non-empty right after generate_async"
    await (mgr.drain() if entry == "drain" else eng.stop_loop())
    nothing_in_flight(eng)
    assert_whole(mgr)
    counters_add_up(eng)
    assert not mgr.metrics.failures and mgr.metrics.cancellations == 0
    nodes = published(eng)
    if write_policy == "write_through":
        assert all(n.pages[Tier.L2] is not None for n in nodes), "an L1 node write_through never backed up"
        if l3:
            assert all(n.pages[Tier.L3] is not None for n in nodes), "an L2 node never written to L3"
    if write_policy != "write_through_selective":
        # nothing was lost: every prompt's full pages are in some tier (write_back: L1 or what it saved)
        for p in PROMPTS:
            m = mgr.tree.match(tuple(p), include_storage=l3, touch=False)
            assert max(m.lengths) == len(p) - len(p) % PAGE, (p, m.lengths)
    if write_policy == "write_back" and l1_pages == 14:
        assert mgr.metrics.backups_done > 0  # (evictions wrote back)
    if entry == "stop_loop":
        await eng.start()
    if write_policy == "write_through":  # a follow-up request is served from L2 once L1 is emptied
        assert mgr.flush(Tier.L1) > 0
        [out] = await eng.generate_async([PROMPTS[0]], SamplingParams(max_tokens=1))
        reusable = len(PROMPTS[0]) - 1
        assert out.cached_tokens.get("l2", 0) == reusable - reusable % PAGE, out.cached_tokens
        await mgr.drain()
        nothing_in_flight(eng)
    await eng.shutdown()
    nothing_in_flight(eng)
    counters_add_up(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_shutdown_without_grace_drops_queued_backups_and_its_counters_add_up(write_policy):
    eng = make_engine(write_policy, l3=True, l1_pages=14)
    await eng.start()
    await serve(eng, rounds=1)
    queued = len(eng.cache.runner._due)
    await eng.shutdown()
    nothing_in_flight(eng)
    counters_add_up(eng)
    if write_policy == "write_through":
        assert queued > 0  # (dropped by the cancelling drain: a temporary L3 goes with the engine)


def _crash_at_second_decode(eng: Engine) -> WriteGate:
    """The loop crashes at its second decode pass (an injected scheduler bug), after PROMPTS[0] finished
    and PROMPTS[1] published its prompt: their backups' L3 writes are held (the gate returned) until the
    crash was raised, so they are surely in flight then."""
    calls, decode_batch = [], eng.admission.decode_batch
    gate = WriteGate(eng.cache.store)

    def broken():
        calls.append(1)
        if len(calls) == 2:
            assert eng.cache.runner.live  # (the backups wait for the gate)
            raise RuntimeError("injected scheduler bug")
        return decode_batch()
    eng.admission.decode_batch = broken
    return gate


CRASH_PARAMS = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=8, ignore_eos=True)]


@pytest.mark.asyncio
async def test_stop_loop_after_a_loop_crash_still_drains_the_operations_in_flight():
    """stop_loop() "ends the loop task and drains the operations in flight"; a crashed loop's error is re-raised
    (scheduler/loop_task.join_loop), but the backups the requests before the crash started drain first
    (regression: it raised before its drain, and returned with them in flight)."""
    eng = make_engine("write_through", l3=True, l1_pages=64)
    gate = _crash_at_second_decode(eng)
    await eng.start()
    reqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS[:2], CRASH_PARAMS)]
    for r in reqs:
        while not (await r.queue.get()).finished:
            pass
    assert eng.cache.pending_ops() > 0
    gate.release()
    with pytest.raises(RuntimeError, match="injected"):
        await eng.stop_loop()
    nothing_in_flight(eng)
    assert_whole(eng.cache)
    counters_add_up(eng)
    assert eng.metrics()["cancellations"] == 0
    with pytest.raises(RuntimeError, match="injected"):  # (shutdown re-raises the crash too, and closes the tiers)
        await eng.shutdown()


def test_generate_after_a_loop_crash_lets_its_backups_land():
    """Engine.generate() ends its private loop with stop_loop(): after a crash its backups in flight were
    cancelled by the loop's teardown (asyncio.run cancels what is left), counted in `cancellations`, and the
    pages of those whose settling never ran stayed private (their claims leaked). The gate opens a little
    later from a timer thread: no timing is asserted, only that stop_loop waits for what is in flight."""
    import asyncio
    eng = make_engine("write_through", l3=True, l1_pages=64)
    gate = _crash_at_second_decode(eng)
    threading.Timer(0.3, gate.release).start()
    released, release_loop = [], eng.cache.release_loop

    async def counted():
        released.append(1)
        await release_loop()
    eng.cache.release_loop = counted
    with pytest.raises(RuntimeError, match="injected"):
        eng.generate(PROMPTS[:2], CRASH_PARAMS)
    assert released == [1]  # (the loop's L3 clients let go after a crash too: a Redis connection pool)
    m = eng.metrics()
    assert m["cancellations"] == 0 and m["backups_started"] == m["backups_done"], m
    nothing_in_flight(eng)
    assert_whole(eng.cache)
    with pytest.raises(RuntimeError, match="injected"):
        asyncio.run(eng.shutdown())


@pytest.mark.asyncio
async def test_pending_backups_count_those_waiting_for_another():
    """A sibling's backup asked for while one sharing its head is in flight waits for it (`_deferred`); the
    pending counts (/hicache/status, hicache_pending_operations) count it (regression: only queued and live
    backups were counted, 1 for these 2)."""
    from hicache_helpers import make_manager, toks, write_prefix

    mgr = make_manager(write_policy="write_through")
    write_prefix(mgr, toks((0, 8), (100, 104)))
    write_prefix(mgr, toks((0, 8), (200, 204)), start=8)
    assert len(mgr.runner.live) == 1 and mgr.runner._deferred  # (the second waits for the first)
    assert mgr.runner.pending_counts()["backups"] == 2
    await mgr.drain()
    assert mgr.runner.pending_counts()["backups"] == 0
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_after_stop_loop_raised_a_crash_add_request_names_the_crash(monkeypatch):
    """stop_loop() re-raises a crashed loop's error; the engine is then crashed, not stopping: add_request names
    the crash and start() as the way on, `accepting` is True again (regression, session 59's crash hunt: "the
    engine loop is stopping (stop_loop)" for good, and a beam step refused then was counted an abort)."""
    import asyncio

    from scheduler.request import RequestError
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE, num_pages=64))
    await eng.start()

    def broken():
        raise RuntimeError("injected scheduler bug")
    monkeypatch.setattr(eng.admission, "decode_batch", broken)
    req = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    while not (await asyncio.wait_for(req.queue.get(), 60)).finished:
        pass
    with pytest.raises(RuntimeError, match="injected"):
        await eng.stop_loop()
    assert eng.accepting and not eng.stopping
    with pytest.raises(RequestError, match="crashed"):
        eng.add_request([4, 5, 6], SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="injected"):
        await eng.shutdown()

"""Bug hunt in admission and scheduling under memory pressure (tiny preset, CPU): requests that can
never fit L1, prompts + max_tokens that fit only alone, many requests whose total exceeds L1, a long
request behind a stream of short ones, the running-requests limit, requests aborted while they wait
(for pages, or for another request's blocking restore), shutdown with requests still queued. The
referee: every request ends (finished, or a clear error / abort) within an asyncio timeout, greedy
outputs of those that finish equal a no-cache engine's, and once all ended and the caches are
flushed every tier is whole and every page free again.

Four failed before their fixes (the first three and the last): with blocking restores, a queued
request aborted (by abort() or shutdown()) while the loop waited for a restore was still admitted,
prefilled and sent a token (scheduler/admission.py, scheduler/restoring.py); `flush_async(L1)`
under write_back and the cost policy left a leaf in L1 with a backup in flight (hicache/manager.py);
a request queued outside a running loop with its prefix in a file L3 raised a bare RuntimeError
and leaked L2 pages to a read no driver owned (scheduler/restoring.py). The rest guard what was
checked and found right."""
from __future__ import annotations

import asyncio
import random

import pytest

from hicache.radix import Tier
from hicache.reuse import TierReuse
from hicache_helpers import ReadGate, WriteGate, assert_whole, until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams
from test_capacity_hunt import make_engine as make_sized_engine
from test_prefix_edges_hunt import VOCAB, reference

PAGE = 4
WAIT_S = 60  # a request that takes longer hangs


def make_engine(num_pages: int = 16, max_running_requests: int = 64, max_prefill_tokens: int = 2048,
                hicache: bool = True, restore_overlap: bool = False, decode_reserve_ratio: float | str = "auto",
                **config) -> Engine:
    config.setdefault("transfer_backend", "torch")
    config.setdefault("policy", "always")
    base = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=PAGE,
                        max_running_requests=max_running_requests, max_prefill_tokens=max_prefill_tokens,
                        restore_overlap=restore_overlap, decode_reserve_ratio=decode_reserve_ratio)
    return Engine(base.with_hicache(enable=True, **config) if hicache else base)


def prompt_of(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(num_tokens)]


async def ended(req) -> None:
    """Wait (bounded) for the request's final event."""
    async def drain():
        while not (await req.queue.get()).finished:
            pass
    await asyncio.wait_for(drain(), WAIT_S)


async def assert_all_free(eng: Engine) -> None:
    """Every request ended and every op settled; the tiers are whole, and flushed, every page of
    every tier is free (a leaked lock, claim or reservation would keep one)."""
    await eng.cache.drain()
    assert not (eng.requests or eng.running or eng.waiting or eng.parked)
    assert eng.admission.reserved_pages == 0
    assert_whole(eng.cache)
    await eng.cache.flush_async(Tier.L1)
    for tier in (Tier.L1, Tier.L2, Tier.L3):
        if tier in eng.cache.tree.allocators:
            eng.cache.flush(tier)
            await eng.cache.drain()
    for tier, alloc in eng.cache.tree.allocators.items():
        assert alloc.num_free == alloc.num_pages, (tier, alloc.num_free, alloc.num_pages)


# -- an abort while the loop waits for another request's blocking restore -----------------------------
@pytest.mark.asyncio
async def test_a_queued_request_aborted_during_anothers_blocking_restore_is_never_prefilled():
    """--disable-hicache-prefetch: the loop waits in its admission pass for A's L3 restore. B, queued
    behind A in that same pass, is aborted meanwhile: abort() returns True. Once A's read landed the
    pass went on to B from the list it had taken before the wait: B was admitted, its prompt
    prefilled and a token sent to its client after its abort, and its prefill counted in the metrics."""
    rng = random.Random(1)
    prefix = prompt_of(rng, 6 * PAGE)
    eng = make_engine(num_pages=64, prefetch=False)
    await eng.start()
    [warm] = await asyncio.wait_for(eng.generate_async([prefix + [1]], [SamplingParams(max_tokens=2)]), WAIT_S)
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    eng.cache.flush(Tier.L2)
    assert eng.cache.tree.match(prefix, touch=False).lengths == [0, 0, len(prefix)]
    gate = ReadGate(eng.cache.store)
    params = SamplingParams(max_tokens=4)
    a = eng.add_request(prefix + [2], params)
    b = eng.add_request(prompt_of(rng, 9), params)  # queued behind A in the same admission pass
    await until(lambda: a.state is RequestState.PARKED)  # the loop waits for A's read
    prefill_before, recomputed_before = eng.stats["prefill_tokens"], eng.metrics()["recomputed_tokens"]
    assert await eng.abort(b.rid)
    gate.release()
    await ended(a)
    await ended(b)
    assert b.finish_reason == "abort" and b.output == [], b.output
    assert a.finish_reason == "length" and a.output == (await reference([prefix + [2]], 4))[0]
    assert eng.stats["prefill_tokens"] - prefill_before == 1  # A's tail only
    assert eng.metrics()["recomputed_tokens"] - recomputed_before == 1
    await assert_all_free(eng)
    await eng.shutdown()


# -- flushed after the requests ended, every tier is empty again --------------------------------------
@pytest.mark.asyncio
async def test_flush_async_under_write_back_and_the_cost_policy_empties_l1():
    """Regression (write_back, policy "cost"): `flush_async(L1)` writes unsaved leaves back, waits,
    then flushes. Where L2's reuse gate declined a leaf's backup (an unproductive L2), the flush's
    eviction veto asked the gate again, which let it through as its probe: the leaf stayed in L1 with
    a backup in flight after flush_async returned ("leaves L1 empty"), so a benchmark's reset began
    its next run with pages held, and flushes of L2 then missed that backup's pages."""
    rng = random.Random(2)
    eng = make_engine(num_pages=16, storage_ratio=0.0, write_policy="write_back", policy="cost")
    await eng.start()
    prompt = prompt_of(rng, 3 * PAGE + 1)
    [r] = await asyncio.wait_for(eng.generate_async([prompt], [SamplingParams(max_tokens=1)]), WAIT_S)
    assert r.output_ids == (await reference([prompt], 1))[0]
    # an L2 none of whose evicted pages were read back: it writes one backup in two (its probe)
    gate = eng.cache.reuse[Tier.L2] = TierReuse(min_evicted_pages=1, probe_every=2)
    gate.on_evicted(8)
    assert not gate.productive
    await eng.stop_loop()
    await eng.cache.drain()
    assert eng.cache.l1.allocator.num_free < eng.cache.l1.num_pages  # the prompt's 3 unsaved pages
    await eng.cache.flush_async(Tier.L1)
    assert eng.cache.l1.allocator.num_free == eng.cache.l1.num_pages, "flush_async left L1 pages"
    await assert_all_free(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_shutdown_during_a_blocking_restore_prefills_none_of_the_requests_it_aborts():
    """--disable-hicache-prefetch: shutdown() (no grace) while the loop waits for A's L3 restore, B
    queued behind it. shutdown aborts both: neither may be prefilled nor sent a token once the
    read landed (A went on from its blocking restore to admission, as if never aborted)."""
    rng = random.Random(3)
    prefix = prompt_of(rng, 6 * PAGE)
    eng = make_engine(num_pages=64, prefetch=False)
    await eng.start()
    await asyncio.wait_for(eng.generate_async([prefix + [1]], [SamplingParams(max_tokens=2)]), WAIT_S)
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    eng.cache.flush(Tier.L2)
    gate = ReadGate(eng.cache.store)
    params = SamplingParams(max_tokens=4)
    a = eng.add_request(prefix + [2], params)
    b = eng.add_request(prompt_of(rng, 9), params)
    await until(lambda: a.state is RequestState.PARKED)
    prefill_before = eng.stats["prefill_tokens"]
    closing = asyncio.create_task(eng.shutdown())
    await until(lambda: eng.stopping)
    gate.release()
    await asyncio.wait_for(closing, WAIT_S)
    await ended(a)
    await ended(b)
    assert [(r.finish_reason, r.output) for r in (a, b)] == [("abort", []), ("abort", [])]
    assert eng.stats["prefill_tokens"] == prefill_before
    assert not (eng.requests or eng.running or eng.waiting or eng.parked)
    assert_whole(eng.cache)


# -- guards: what this hunt checked and found right ---------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("hicache", [False, True])
async def test_requests_that_never_fit_l1_are_refused_alone_and_the_rest_fit_in_turn(hicache):
    """L1 of 16 pages (64 tokens): a prompt longer than L1, and one that fits only without its
    max_tokens, are refused naming the cause; eight that each fit alone but not all together (each
    needs 10 of the 16 pages: they run one by one) finish with the no-cache outputs."""
    rng = random.Random(4)
    eng = make_engine(num_pages=16, hicache=hicache, storage_ratio=0.0)
    await eng.start()
    fits = [prompt_of(rng, 30) for _ in range(8)]
    prompts = [prompt_of(rng, 65), prompt_of(rng, 60)] + fits
    params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=6)] + [SamplingParams(max_tokens=11)] * 8
    out = await asyncio.wait_for(eng.generate_async(prompts, params), WAIT_S)
    assert out[0].finish_reason == "error" and "exceeds" in out[0].error
    assert out[1].finish_reason == "error" and "max_tokens" in out[1].error
    assert [r.finish_reason for r in out[2:]] == ["length"] * 8
    assert [r.output_ids for r in out[2:]] == await reference(fits, 11)
    assert "l1_overcommit" not in eng.metrics()["failures"]
    await eng.stop_loop()
    await assert_all_free(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_long_request_is_not_starved_by_a_stream_of_short_ones():
    """L1 of 16 pages; a stream of short requests keeps arriving, each taking 3 pages while it runs.
    A long one (14 pages) arriving in the middle of it is admitted before every short one that
    arrived after it (FIFO: none jumps it while it waits for pages)."""
    rng = random.Random(5)
    eng = make_engine(num_pages=16, hicache=False)
    await eng.start()
    shorts, stop = [], asyncio.Event()

    async def stream():
        while not stop.is_set():
            shorts.append(eng.add_request(prompt_of(rng, 6), SamplingParams(max_tokens=4)))
            await asyncio.sleep(0.002)
    streaming = asyncio.create_task(stream())
    await until(lambda: len(shorts) >= 4)
    long_prompt = prompt_of(rng, 50)
    long = eng.add_request(long_prompt, SamplingParams(max_tokens=6))
    after = len(shorts)
    try:
        await ended(long)
        await until(lambda: len(shorts) >= after + 4)  # (the stream went on while it waited)
    finally:
        stop.set()
        await streaming
    for req in shorts:
        await ended(req)
    assert long.finish_reason == "length" and long.output == (await reference([long_prompt], 6))[0]
    assert all(r.finish_reason == "length" for r in shorts)
    assert all(r.first_token_s >= long.first_token_s for r in shorts[after:])
    await eng.stop_loop()
    await assert_all_free(eng)
    await eng.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("prefetch,overlap", [(True, True), (True, False), (False, False)])
async def test_the_running_limit_holds_with_restores_and_everything_finishes(prefetch, overlap):
    """max_running_requests=2 with twelve requests over three prefixes that only L2 or L3 hold (restores
    parked, blocking or overlapped with the tail's forward) on an L1 that holds three of them: never
    more than two run at once, and every one finishes with the no-cache output."""
    rng = random.Random(6)
    bases = [prompt_of(rng, 5 * PAGE) for _ in range(3)]
    eng = make_engine(num_pages=20, max_running_requests=2, prefetch=prefetch, restore_overlap=overlap)
    await eng.start()
    warm = [b + [1] for b in bases]
    await asyncio.wait_for(eng.generate_async(warm, [SamplingParams(max_tokens=1)] * 3), WAIT_S)
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    eng.cache.flush(Tier.L2)  # bases[*] in L3 only
    most_running = 0
    after_batch = eng._after_batch

    def counting(*args):
        nonlocal most_running
        most_running = max(most_running, len(eng.running))
        after_batch(*args)
    eng._after_batch = counting
    prompts = [bases[i % 3] + [rng.randrange(VOCAB) for _ in range(1 + i % 4)] for i in range(12)]
    out = await asyncio.wait_for(eng.generate_async(prompts, SamplingParams(max_tokens=5)), WAIT_S)
    assert most_running == 2
    assert [r.output_ids for r in out] == await reference(prompts, 5)
    assert sum(r.cached_tokens["l2"] + r.cached_tokens["l3"] for r in out) > 0
    await eng.stop_loop()
    await assert_all_free(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_requests_aborted_or_shut_down_while_waiting_for_pages_end_once_and_free_everything():
    """L1 of 64 pages: A (53 pages reserved) runs a long generation; B, C and D (12 pages each) wait
    for pages behind it. B is aborted while waiting; then shutdown() ends A, C and D: each gets
    exactly one final event, the queued ones no token, shutdown returns, and nothing leaks."""
    rng = random.Random(7)
    eng = make_engine(num_pages=64, storage_ratio=0.0, decode_reserve_ratio=1.0)  # (each reserving all of it)
    await eng.start()
    a = eng.add_request(prompt_of(rng, 10), SamplingParams(max_tokens=200, ignore_eos=True))
    await until(lambda: a.state is RequestState.DECODE)
    waiting = [eng.add_request(prompt_of(rng, 40), SamplingParams(max_tokens=8)) for _ in range(3)]
    batches = eng.stats["batches"]
    await until(lambda: eng.stats["batches"] >= batches + 2)  # the loop planned with them queued
    assert [r.state for r in waiting] == [RequestState.WAITING] * 3 and not a.state.done
    assert await eng.abort(waiting[0].rid)
    await ended(waiting[0])
    assert waiting[0].finish_reason == "abort" and waiting[0].output == []
    await asyncio.wait_for(eng.shutdown(), WAIT_S)
    for req in [a] + waiting[1:]:  # (B's final event was taken above)
        events = []
        while not req.queue.empty():
            events.append(req.queue.get_nowait())
        assert [ev.finish_reason for ev in events if ev.finished] == [req.finish_reason], req.rid
    assert a.finish_reason in ("abort", "length")
    assert [(r.finish_reason, r.output) for r in waiting[1:]] == [("abort", [])] * 2
    assert not (eng.requests or eng.running or eng.waiting or eng.parked)
    assert_whole(eng.cache)
    for tier, alloc in eng.cache.tree.allocators.items():
        assert alloc.num_private() == 0, tier


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy,prefetch", [("write_through", True), ("write_through", False),
                                                   ("write_back", True), ("write_back", False)])
async def test_a_restore_that_finds_l2_full_of_pages_held_by_l3_writes_recomputes_without_waiting(
        write_policy, prefetch):
    """L2 of 4 pages, all locked by an L3 write that is held (slow storage); a request whose 4-page
    prefix only L3 holds cannot read it into L2: it recomputes now (no wait for the write), with the
    no-cache output; once the write completes every tier is whole and every page free."""
    rng = random.Random(8)
    eng = make_sized_engine(PAGE, 32, 4, 16, write_policy=write_policy, prefetch=prefetch, policy="always",
                            restore_overlap=False)
    await eng.start()
    x, y = prompt_of(rng, 4 * PAGE), prompt_of(rng, 4 * PAGE)
    await asyncio.wait_for(eng.generate_async([x + [1]], [SamplingParams(max_tokens=1)]), WAIT_S)
    await eng.cache.flush_async(Tier.L1)
    await eng.cache.drain()
    eng.cache.flush(Tier.L2)
    assert eng.cache.tree.match(x, touch=False).lengths == [0, 0, 4 * PAGE]
    gate = WriteGate(eng.cache.store)
    try:
        await asyncio.wait_for(eng.generate_async([y + [1]], [SamplingParams(max_tokens=1)]), WAIT_S)
        if write_policy == "write_back":
            eng.cache.flush(Tier.L1)  # its backup starts; the L3 write after it is held
        await until(lambda: eng.cache.l2.allocator.num_free == 0 and eng.cache.tree.evictable_pages(Tier.L2) == 0)
        [r] = await asyncio.wait_for(eng.generate_async([x + [2]], [SamplingParams(max_tokens=3)]), WAIT_S)
        assert r.finish_reason == "length" and r.output_ids == (await reference([x + [2]], 3))[0]
        assert r.cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
    finally:
        gate.release()
    await eng.stop_loop()
    await assert_all_free(eng)
    await eng.shutdown()


# -- a request queued outside a running loop ----------------------------------------------------------
def test_a_request_queued_outside_a_loop_whose_prefix_only_l3_holds_prefetches_once_the_loop_runs():
    """Regression (file L3, prefetch on): add_request is allowed outside a running loop (the loop
    that later runs it admits it). Queued so while its prefix was in L3 only, its queue-time
    prefetch started the storage read into private L2 pages, then failed to register its driver
    ("no running event loop"): add_request raised a bare RuntimeError and those L2 pages stayed
    held for good, with a read landing in them. The prefetch now starts once a loop runs it."""
    rng = random.Random(9)
    prefix = prompt_of(rng, 6 * PAGE)
    eng = make_engine(num_pages=64)
    eng.generate([prefix + [1]], SamplingParams(max_tokens=2))
    eng.cache.flush(Tier.L1)
    eng.cache.flush(Tier.L2)
    assert eng.cache.tree.match(prefix, touch=False).lengths == [0, 0, len(prefix)]
    req = eng.add_request(prefix + [2], SamplingParams(max_tokens=3))  # no loop runs here
    assert eng.cache.l2.allocator.num_private() == 0

    async def run():
        await eng.start()
        await ended(req)
        assert req.finish_reason == "length" and req.output == (await reference([prefix + [2]], 3))[0]
        assert req.hit_tokens == {"l1": 0, "l2": 0, "l3": len(prefix)}
        await eng.stop_loop()
        await assert_all_free(eng)
        await eng.shutdown()
    asyncio.run(run())

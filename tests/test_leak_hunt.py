"""A hunt for state a long-running server accumulates (tiny preset, CPU): after a workload of hits,
evictions, aborts, faults and prefetches has ended, every container keyed by request, op, claim or
node is back to its idle size (or within its documented cap), and repeated `generate` calls and
engine lifecycles leave no task, thread or file descriptor behind.

The first two failed before their fixes: a read whose checksums were held for a take-on
(hicache/storage_op.py) and that failed stayed in its store's held set for good, one per failed
read; and under write-through every failed backup's whole token key was kept (up to 1,024 of them)
by bookkeeping that only write-back reads (hicache/operations.py `_fail`).
"""
from __future__ import annotations

import asyncio
import gc
import inspect
import os
import random
import threading

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.radix import TIERS, Tier
from hicache_helpers import assert_whole
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

VOCAB = 512
PAGE = 4


def make_engine(faults: FaultInjector | None = None, num_pages: int = 64, max_running_requests: int = 8,
                **hicache) -> Engine:
    hicache.setdefault("transfer_backend", "torch")
    hicache.setdefault("policy", "always")
    config = EngineConfig(model="tiny", device="cpu", num_pages=num_pages, page_size=PAGE,
                          max_running_requests=max_running_requests).with_hicache(enable=True, **hicache)
    return Engine(config, faults=faults)


async def flush(eng: Engine, tier: Tier) -> None:
    done = eng.cache.flush(tier)
    if inspect.isawaitable(done):  # (an L1 flush may wait for the backups it lets finish)
        await done


async def prefix_only_in_l3(eng: Engine, prefix: list[int]) -> None:
    await eng.generate_async([prefix + [1]], SamplingParams(max_tokens=2))
    await eng.cache.drain()
    await flush(eng, Tier.L1)
    await flush(eng, Tier.L2)
    await eng.cache.drain()
    assert eng.cache.tree.match(prefix, touch=False).lengths == [0, 0, len(prefix)]


def assert_idle(eng: Engine) -> None:
    """Nothing of a request or an op outlives it: the engine's queues, admission's bookkeeping, the
    op runner's, every allocator's claims and the L3 store's held reads are back to idle; bounded
    ones within their bounds; integrity holds."""
    runner, adm, tree = eng.cache.runner, eng.admission, eng.cache.tree
    assert not (eng.requests or eng.waiting or eng.running or eng.parked or eng.aborting)
    assert adm.reserved_pages == 0 and not adm.fallback_end_tokens
    assert not (runner.live or runner._tasks or runner._settling or runner._backing_up or runner._deferred
                or runner._l3_writing or runner._due), runner.pending_counts()
    assert len(runner._backup_failed) <= 1024
    for tier, alloc in tree.allocators.items():
        held = eng.held_l1_pages if tier is Tier.L1 else 0  # (claims taken for good at start)
        assert len(alloc._held) == len(alloc.claim_labels) == held, (tier, alloc.claim_labels)
    for tier in TIERS:  # the eviction heap is rebuilt past twice the resident pages + 64
        assert len(tree._candidates[tier]) <= 2 * tree.num_resident_pages[tier] + 64, tier
    store = eng.cache.store
    assert not store._held, f"{len(store._held)} finished reads still held by the store"
    assert store.stats()["active_tasks"] == 0
    gc.collect()
    assert len(eng.cache.transfer._completions) == 0
    assert len(list(eng.cache.transfer.workspaces)) <= 1  # at most one idle workspace is kept
    assert_whole(eng.cache)


# -- found by this hunt ------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_failed_read_whose_checksums_were_held_is_not_kept_by_the_store():
    """Regression: a request alone in its batch prefetches its L3 prefix to take it on to L1, so
    its read's checksums wait for the take-on (`hold_checks`). When that read failed (EIO here),
    nothing let its checks go and the store kept it in its held set for good: one StorageOp (its
    slots, expected checksums and pending checksum jobs) per failed read, for the life of the
    server. Each request still recomputes and gets the no-cache output."""
    faults = FaultInjector()
    eng = make_engine(faults)
    await eng.start()
    rng = random.Random(3)
    for i in range(3):
        prefix = [rng.randrange(VOCAB) for _ in range(6 * PAGE)]
        await prefix_only_in_l3(eng, prefix)
        faults.arm(Fault.EIO_READ, times=1)
        [out] = await eng.generate_async([prefix + [2]], SamplingParams(max_tokens=2))
        await eng.cache.drain()
        assert out.finish_reason == "length" and faults.fired[Fault.EIO_READ] == i + 1
    assert eng.metrics()["failures"].get("eio") == 3
    held = len(eng.cache.store._held)
    await eng.stop_loop()
    assert held == 0, f"{held} failed reads still held by the store"
    assert_idle(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_failed_write_through_backups_are_not_remembered():
    """Regression: every failed backup's whole token key went into `_backup_failed` (up to 1,024
    keys, each as long as its prompt), which only the write-back eviction veto ever reads. Under
    write-through, with an L3 that refuses writes (a full Redis under noeviction fails every one),
    it filled with prompt-long tuples nothing would look at."""
    faults = FaultInjector()
    faults.arm(Fault.ENOSPC_WRITE, times=None)
    eng = make_engine(faults, write_policy="write_through")
    eng.cache.store.enospc_backoff_s = (0.0, 0.0)  # every backup tries (the backoff: test_l3_reserve_hunt.py)
    await eng.start()
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(5 * PAGE + 1)] for _ in range(6)]
    await eng.generate_async(prompts, SamplingParams(max_tokens=2))
    await eng.stop_loop()
    assert eng.metrics()["failures"].get("enospc", 0) >= 6
    assert not eng.cache.runner._backup_failed, f"{len(eng.cache.runner._backup_failed)} keys kept"
    assert_idle(eng)
    await eng.shutdown()


# -- checked and found right (guards) ----------------------------------------------------------------
def armed(seed: int, probability: float) -> FaultInjector:
    faults = FaultInjector()
    for i, fault in enumerate(Fault):
        faults.arm(fault, times=None, probability=probability, seed=seed * 31 + i,
                   delay_s=0.02 if fault in (Fault.SLOW_READ, Fault.SLOW_VERIFY) else 0.0)
    return faults


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_an_engine_idle_after_a_faulty_workload_keeps_nothing_of_it(write_policy):
    """A few hundred requests over shared prefixes through all three tiers (small L1 and L2, so
    prefixes are evicted, restored and prefetched from L3, often by a request alone that takes its
    read on to L1), every fault armed, some aborted at random moments: once idle, every container
    keyed by request, op, claim or node is back to its idle size (`assert_idle`)."""
    rng = random.Random(7)
    faults = armed(seed=len(write_policy), probability=0.06)
    eng = make_engine(faults, num_pages=48, max_running_requests=4, write_policy=write_policy, host_ratio=1.0,
                      storage_ratio=4.0, io_timeout_s=0.02)
    await eng.start()
    bases = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(10)]
    slots = asyncio.Semaphore(3)  # often one at a time: prefetches taken on to L1

    async def one(i: int) -> str:
        async with slots:
            prompt = rng.choice(bases)[: rng.randrange(3 * PAGE, 41)] + [i % VOCAB]
            req = eng.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 5)))
            if rng.random() < 0.15:
                asyncio.get_running_loop().call_later(rng.uniform(0.0, 0.02),
                                                      lambda: asyncio.ensure_future(eng.abort(req.rid)))
            while not (ev := await req.queue.get()).finished:
                pass
            return ev.finish_reason

    reasons = await asyncio.gather(*(one(i) for i in range(160)))
    faults.disarm()
    await eng.stop_loop()
    fired = faults.fired
    assert "abort" in reasons and fired[Fault.EIO_READ] + fired[Fault.SHORT_READ] > 0
    m = eng.metrics()
    assert m["promotions"] > 0 and m["restores_done"] > 0 and eng.stats["restore_overlaps"] > 0
    assert_idle(eng)
    await eng.shutdown()


def _resources() -> tuple[int, int]:
    """(threads, open file descriptors) of the process, once garbage is collected."""
    gc.collect()
    return len(threading.enumerate()), len(os.listdir("/proc/self/fd"))


def test_repeated_generate_calls_and_engine_lifecycles_leave_no_task_thread_or_fd():
    """`Engine.generate` run again and again on one engine (each on a fresh loop), then engines
    started, used and shut down one after another: the process's threads and file descriptors never
    grow past what the first round left, and each shut-down loop holds no task but its own."""
    rng = random.Random(11)
    prefix = [rng.randrange(VOCAB) for _ in range(6 * PAGE)]
    eng = make_engine()
    rounds = []
    for i in range(3):
        out = eng.generate([prefix + [i], prefix + [i, i]], SamplingParams(max_tokens=3))
        assert [r.finish_reason for r in out] == ["length", "length"]
        eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)  # next round restores from L2
        rounds.append(_resources())
    assert all(r[0] <= rounds[0][0] and r[1] <= rounds[0][1] for r in rounds), rounds
    assert_idle(eng)

    async def lifecycle() -> list:
        e = make_engine()
        await e.start()
        await e.generate_async([prefix + [1], prefix + [2]], SamplingParams(max_tokens=3))
        await flush(e, Tier.L1)
        await flush(e, Tier.L2)
        await e.generate_async([prefix + [3]], SamplingParams(max_tokens=3))  # from L3
        await e.shutdown()
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    cycles = []
    for _ in range(3):
        assert asyncio.run(lifecycle()) == []
        cycles.append(_resources())
    assert all(c[0] <= rounds[0][0] and c[1] <= rounds[0][1] for c in cycles), (rounds, cycles)

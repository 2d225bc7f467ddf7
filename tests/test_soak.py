"""Soak: many requests with random shared prefixes and lengths through an engine with all three tiers,
every fault armed at a low probability, random aborts and random L3 bit flips. At the end every pool
is whole (nothing private in any tier, integrity holds) and every output equals what a no-cache engine
computes for the same prompt (greedy; an aborted request's partial output is a prefix of it).

Default size is CI-sized; the full size (>= 2,000 requests) runs with --run-slow.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from hicache_helpers import assert_whole, flip_l3_byte, read_stream
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

VOCAB = 512
PAGE = 4
MAX_TOKENS = 8
FAULT_PROBABILITY = 0.02


def workload(num_requests: int, seed: int) -> list[tuple[list[int], int, float | None]]:
    """(prompt, max_tokens, abort_after_s or None) per request: a few shared bases cut at random
    lengths plus random tails, so prefixes are shared, split and evicted."""
    rng = random.Random(seed)
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randrange(24, 64))] for _ in range(8)]
    out = []
    for _ in range(num_requests):
        base = rng.choice(bases)
        prompt = base[: rng.randrange(PAGE, len(base) + 1)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        abort_after_s = rng.uniform(0.0, 0.01) if rng.random() < 0.1 else None
        out.append((prompt, rng.randrange(1, MAX_TOKENS + 1), abort_after_s))
    return out


async def reference(prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """MAX_TOKENS greedy tokens per distinct prompt from an engine without any cache (a shorter
    max_tokens gives a prefix of these: the random presets have no EOS)."""
    distinct = sorted({tuple(p) for p in prompts})
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=4096, page_size=PAGE,
                              enable_prefix_cache=False, max_running_requests=64))
    out = await eng.generate_async([list(p) for p in distinct], SamplingParams(max_tokens=MAX_TOKENS))
    await eng.shutdown()
    return {p: r.output_ids for p, r in zip(distinct, out)}


def armed_injector(seed: int) -> FaultInjector:
    faults = FaultInjector()
    for i, fault in enumerate(Fault):
        faults.arm(fault, times=None, probability=FAULT_PROBABILITY, seed=seed * 31 + i,
                   delay_s=0.08 if fault is Fault.SLOW_READ else 0.0)
    return faults


async def soak(num_requests: int, seed: int = 0, concurrency: int = 12) -> dict:
    requests = workload(num_requests, seed)
    faults = armed_injector(seed)
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=96, page_size=PAGE, max_running_requests=8)
                 .with_hicache(enable=True, policy="always", transfer_backend="torch", host_ratio=1.5,
                               storage_ratio=2.0, io_timeout_s=0.03), faults=faults)
    await eng.start()
    rng = random.Random(seed + 1)
    results: list = [None] * len(requests)
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        prompt, max_tokens, abort_after_s = requests[i]
        async with slots:
            req = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens))
            if abort_after_s is not None:
                asyncio.get_running_loop().call_later(abort_after_s, lambda: asyncio.ensure_future(eng.abort(req.rid)))
            tokens, reason = await read_stream(req)
            results[i] = (tokens, reason, req)
            if rng.random() < 0.05 and eng.cache.has_l3:  # corrupt a random published L3 page
                slots_l3 = eng.cache.tree.tree_pages(Tier.L3)
                if slots_l3:
                    flip_l3_byte(eng.cache, rng.choice(slots_l3))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(requests))))
    elapsed_s = time.perf_counter() - t0
    faults.disarm()
    await eng.stop_loop()
    await eng.cache.drain()
    assert not eng.requests
    assert_whole(eng.cache)  # every tier: owned + free = capacity, nothing private, no locks

    want = await reference([p for p, _, _ in requests])
    num_aborted = 0
    for i, ((prompt, max_tokens, _), (tokens, reason, req)) in enumerate(zip(requests, results)):
        expected = want[tuple(prompt)][:max_tokens]
        why = (f"request {i}: {reason} {tokens} != {expected}; prompt {len(prompt)} tokens, hits "
               f"{req.hit_tokens}, restore {req.restore_tier}, restore_failed {req.restore_failed}")
        if reason == "abort":
            num_aborted += 1
            assert tokens == expected[: len(tokens)], why
        else:
            assert reason == "length" and tokens == expected, why
    metrics = eng.metrics()
    await eng.shutdown()
    return {"elapsed_s": elapsed_s, "aborted": num_aborted, "fired": faults.fired, "metrics": metrics}


def check_report(report: dict, num_requests: int) -> None:
    fired, metrics = report["fired"], report["metrics"]
    assert sum(fired.values()) > 0 and report["aborted"] > 0
    assert metrics["restores_done"] > 0 and metrics["promotions"] > 0  # the lower tiers really served
    assert metrics["evictions_pages"]["l1"] > 0 and metrics["evictions_pages"]["l2"] > 0
    assert sum(metrics["failures"].values()) > 0 and metrics["fallbacks"] > 0


@pytest.mark.asyncio
async def test_soak_ci():
    report = await soak(300, seed=1)
    check_report(report, 300)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_soak_full():
    report = await soak(2000, seed=2)
    check_report(report, 2000)
    print(f"\nsoak 2000 requests: {report['elapsed_s']:.1f} s, aborted {report['aborted']}, "
          f"faults fired {({f.value: n for f, n in report['fired'].items() if n})}, "
          f"failures {report['metrics']['failures']}")

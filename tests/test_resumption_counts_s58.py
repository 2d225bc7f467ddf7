"""A preempted request is counted once (session 58's hunt): its resumption reads its own K/V, so, as for its hits
(docs/design.md, preemption: "Its result and the metrics keep its first admission's hits"), a resumption that
recomputes what L2 holds of it counts no second restore policy skip (policy_skips["restore"]: "requests admitted to
recompute a hit a lower tier held, by policy (once per request)"), and one whose restore failed no second fallback
(`fallbacks`: "requests admitted to compute what a restore ... of their own was to bring ... once"). Each count is
the same with and without preemption."""
from __future__ import annotations

import asyncio

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams
from test_preemption import config

PREFIX = [9, 8, 7, 6] * 5  # 5 pages of 4, in L2 alone when the requests arrive: each prompt's lower-tier hit


def decline_every_restore(eng: Engine) -> None:
    """The cost policy's answer where a restore never pays (its prices: recompute cheaper than any copy): every
    hit a lower tier holds is recomputed. Writes stay as configured (policy "always"), so L2 keeps getting them."""
    decide = eng.cache.cost.decide

    def declined(l1, l2, l3, policy="cost", *args, **kw):
        return decide(l1, l2, l3, "never", *args, **kw)
    eng.cache.cost.decide = declined


def fail_every_restore(eng: Engine, faults: FaultInjector) -> None:
    """Every H2D (a restore's copy) fails: the fault injection armed once before each."""
    transfer = eng.cache.transfer
    for name in ("h2d", "h2d_layerwise"):
        copy = getattr(transfer, name)

        def failing(*args, copy=copy, **kw):
            faults.arm(Fault.TRANSFER_RAISE, times=1)
            return copy(*args, **kw)
        setattr(transfer, name, failing)


def counted_at_admission(eng: Engine, count) -> list[tuple[str, int]]:
    """(rid, resumed output tokens) of each admission that raised `count` (a skip or a fallback)."""
    seen, admit = [], eng.admission._admit

    async def admitted(req, *args, **kw):
        before, resumed = count(eng), req.resumed_tokens
        out = await admit(req, *args, **kw)
        seen.extend([(req.rid, resumed)] * (count(eng) - before))
        return out
    eng.admission._admit = admitted
    return seen


def skips(eng: Engine) -> int:
    return eng.cache.metrics.policy_skips["restore"]


def fallbacks(eng: Engine) -> int:
    return eng.cache.metrics.fallbacks


async def run(ratio: float, mode: str) -> tuple[Engine, list, list]:
    faults = FaultInjector()
    eng = Engine(config(ratio, "l2"), faults=faults)
    await eng.start()
    await eng.generate_async([PREFIX + [1]], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    await eng.cache.flush_async(Tier.L1)  # (the prefix in L2 alone)
    assert eng.cache.tree.match(PREFIX, include_storage=False, touch=False).lengths[Tier.L2] == len(PREFIX)
    if mode == "decline":
        decline_every_restore(eng)
    else:
        fail_every_restore(eng, faults)
    seen = counted_at_admission(eng, skips if mode == "decline" else fallbacks)
    reqs = [eng.add_request(PREFIX + [(i * 13 + j * 7) % 200 + 30 for j in range(3 + i)],
                            SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(10)]
    while not all(r.state.done for r in reqs):
        await asyncio.sleep(0.002)
    await eng.cache.drain()
    eng.cache.check_integrity()
    return eng, reqs, seen


@pytest.mark.parametrize("mode", ["decline", "fail"])
@pytest.mark.parametrize("ratio", [1.0, 0.0])
@pytest.mark.asyncio
async def test_a_preempted_request_counts_one_policy_skip_or_fallback(mode, ratio):
    """The prefix is in L2 alone as ten requests sharing it arrive; every restore is declined by the cost policy
    (or fails, by fault injection). A request that recomputed it (the first, and any admitted before the prefix it
    computes was published: the rest hit it in L1) counts one skip (or fallback). Preempted (ratio 0), a request
    resumes from its own K/V, in L2 alone where L1 evicted it meanwhile: recomputing that counts nothing more."""
    eng, reqs, seen = await run(ratio, mode)
    try:
        assert all(r.state is RequestState.FINISHED and len(r.output) == 50 for r in reqs)
        assert (eng.stats["preempted"] > 0) == (ratio == 0.0)
        recomputed_prefix = sum(r.result().cached_tokens == {"l1": 0, "l2": 0, "l3": 0} for r in reqs)
        assert recomputed_prefix >= 1
        assert [resumed for _, resumed in seen if resumed] == []  # (regression: each resumption that recomputed
        # its own K/V from L2 counted another)
        assert len({rid for rid, _ in seen}) == len(seen)  # (once per request)
        count = skips if mode == "decline" else fallbacks
        assert count(eng) == recomputed_prefix, (count(eng), recomputed_prefix, seen, eng.stats["preempted"])
    finally:
        await eng.shutdown()

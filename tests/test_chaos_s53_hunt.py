"""Regressions from session 53's chaos hunt (random workloads over tiny tiers, aborts, resets, faults): a reset of
L1 with L2 under write_back left the prefix cached (L1's unsaved pages were written back to L2 first, and the L2
flush left them), and a request aborted while parked on its restore reported the hits it never got."""
from __future__ import annotations

import asyncio

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from scheduler.api_admin import reset_tiers
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

PROMPT = list(range(10, 43))  # 33 tokens: 8 pages of 4 cached


def engine(faults=None, **hicache) -> Engine:
    config = EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4)
    return Engine(config.with_hicache(enable=True, policy="always", transfer_backend="torch", **hicache),
                  faults=faults)


def resident(eng) -> dict:
    return {t.label: eng.cache.tree.num_resident_pages[t] for t in Tier}


@pytest.mark.parametrize("tiers,left,cached", [
    ((Tier.L1, Tier.L2, Tier.L3), {"l1": 0, "l2": 0, "l3": 0}, 0),
    ((Tier.L1, Tier.L2), {"l1": 0, "l2": 0, "l3": 0}, 0),
    ((Tier.L1,), {"l1": 0, "l2": 8, "l3": 8}, 32),  # (L2 kept: written back there, as before)
    ((Tier.L1, Tier.L3), {"l1": 0, "l2": 8, "l3": 0}, 32)])  # (its L3 writes landed before L3's flush: the rerun)
@pytest.mark.asyncio
async def test_a_write_back_reset_of_l1_and_l2_leaves_nothing_to_hit(tiers, left, cached):
    eng = engine(write_policy="write_back")
    await eng.generate_async([PROMPT], SamplingParams(max_tokens=2))
    await asyncio.sleep(0.2)  # (idle: every op settled)
    assert resident(eng)["l1"] == 8
    answer = await reset_tiers(eng.cache, tiers)
    assert answer["pages_left"] == {t.label: 0 for t in tiers}
    await asyncio.sleep(0.2)
    assert resident(eng) == left
    again = (await eng.generate_async([PROMPT], SamplingParams(max_tokens=2)))[0]
    assert sum(again.cached_tokens.values()) == cached
    eng.cache.check_integrity()
    await eng.shutdown()


@pytest.mark.asyncio
async def test_a_request_aborted_on_its_restore_reports_no_hits():
    faults = FaultInjector()
    eng = engine(faults, prefetch=False)
    await eng.generate_async([PROMPT], SamplingParams(max_tokens=2))
    await eng.stop_loop()
    await eng.cache.drain()
    await eng.cache.flush_async(Tier.L1)
    await eng.cache.flush_async(Tier.L2)  # (the prefix in L3 alone)
    await eng.start()
    faults.arm(Fault.SLOW_READ, times=None, delay_s=0.5)
    before = dict(eng.metrics()["hit_tokens"])
    req = eng.add_request(PROMPT, SamplingParams(max_tokens=4))
    while req.restore_op is None:
        await asyncio.sleep(0.001)
    await eng.abort(req.rid)
    while not req.state.done:
        await asyncio.sleep(0.001)
    result = req.result()
    assert result.finish_reason == "abort" and result.output_ids == []
    assert result.cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
    assert eng.metrics()["hit_tokens"] == before  # (what the metrics count, the request's agrees with)
    faults.disarm()
    eng.cache.check_integrity()
    await eng.shutdown()

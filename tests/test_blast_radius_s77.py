"""Session 77's hunt for the blast radius of one bad request: what goes wrong for one request must fail that request
alone, and leave nothing behind that fails the next ones.

An L3 page whose bytes are garbage (storage corruption: non-finite floats, which random bytes almost always hold in
bf16) is caught by its checksum. Where the request's prefetch had already been taken on to L1 while those checksums
ran (its tail forward overlapped with the H2D), the garbage had landed in the op's private L1 pages: the op fails, the
forward is discarded and the request recomputes, as documented. But those L1 pages went back to the free pool as they
were, NaN, and the pool must hold finite values (scheduler/attention.py: the unwritten tail of a request's last page
is read and masked, and NaN * 0 is NaN): each later request given one of them as its last page failed, "the model's
logits for this request were NaN", and its own prefix was dropped from the cache as the suspect. So did the pages
of the request's own tail, where its discarded forward wrote K/V made of that garbage (Restoring._rewind), and where
its request was aborted before the checksums failed (Admission.release)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hicache.allocator import FREE
from hicache.faults import Fault, FaultInjector
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import assert_whole
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from test_faults import PAGE, PROMPT, REUSABLE, finish, only_in_l3, reference, run_one, until
from test_prefetch_take_on import _prefix_only_in_l3


def garble_l3_page(mgr, slot: int) -> None:
    """Every byte of an L3 slot 0xFF: each float of it a NaN (its checksum no longer matches)."""
    with open(mgr.store.path, "r+b") as f:
        f.seek(slot * mgr.store.bytes_per_page)
        f.write(b"\xff" * mgr.store.bytes_per_page)


def free_pages_not_finite(eng) -> list[int]:
    alloc, kv = eng.cache.l1.allocator, eng.cache.l1.kv
    free = [p for p in range(alloc.num_pages) if alloc.owner[p] == FREE]
    return [p for p in free if not torch.isfinite(kv[:, :, p]).all()]


@pytest.mark.asyncio
async def test_a_garbled_l3_page_taken_on_to_l1_leaves_no_nan_in_the_pool_for_later_requests():
    faults = FaultInjector()
    eng = await _prefix_only_in_l3(faults, write_policy="write_through_selective")
    l3_pages = eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).pages[Tier.L3]
    for slot in l3_pages:
        garble_l3_page(eng.cache, slot)
    result = await run_one(eng)  # (taken on to L1 while SLOW_VERIFY holds its checksums: they fail)
    assert result.output_ids == await reference(PROMPT) and result.cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
    await eng.cache.drain()
    assert eng.metrics()["failures"] == {"checksum": 1}
    assert free_pages_not_finite(eng) == [], "the garbled pages went back to the free pool as they were"
    faults.disarm()
    # short requests, each given a free page as its last, partly written one (its tail read and masked)
    for i in range(6):
        prompt = [100 + i, 200 + i]
        [out] = await eng.generate_async([prompt], SamplingParams(max_tokens=3))
        assert out.error is None and out.output_ids == await reference(prompt, 3), (i, out.error)
    assert "nan_logits" not in eng.metrics()["failures"]
    assert_whole(eng.cache)
    await finish(eng)


async def garbled_take_on(extra: list[int]) -> tuple[Engine, FaultInjector, list[int], int]:
    """An engine of one running slot (priority scheduling) whose prefix of PROMPT only L3 holds, garbled; the request of
    PROMPT + extra will be taken on to L1 behind its checksums (SLOW_VERIFY): (engine, faults, prompt, batches run)."""
    faults = FaultInjector()
    config = EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=PAGE, max_running_requests=1,
                          scheduling_policy="priority").with_hicache(enable=True, policy="always",
                                                                     transfer_backend="torch",
                                                                     write_policy="write_through_selective")
    eng = Engine(config, faults=faults)
    await eng.start()
    await run_one(eng)
    eng.cache.runner.start_backup(PROMPT[:REUSABLE])
    await eng.cache.drain()
    only_in_l3(eng, PROMPT[:REUSABLE])
    for slot in eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).pages[Tier.L3]:
        garble_l3_page(eng.cache, slot)
    faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=0.3)  # (the take-on's forward runs before its checksums end)
    batches = eng.stats["batches"]
    return eng, faults, PROMPT + extra, batches


@pytest.mark.asyncio
async def test_the_tail_a_forward_wrote_over_a_garbled_take_on_goes_back_zeroed_for_the_next_request():
    """The request's own tail pages: its forward behind the garbled take-on wrote NaN K/V there. A more urgent request
    queued meanwhile (one running slot: admitted as soon as the garbled one goes back to the queue) takes those pages
    first, its last one partly written: it must get its own output, not fail on NaN."""
    eng, faults, garbled, _ = await garbled_take_on([300, 301, 302])
    urgent = [100, 200]
    first = asyncio.ensure_future(eng.generate_async([garbled], SamplingParams(max_tokens=4)))
    await until(lambda: any(op.state is OpState.H2D_VERIFYING for op in eng.cache.runner.live.values()))
    second = asyncio.ensure_future(eng.generate_async([urgent], SamplingParams(max_tokens=4, priority=-1)))
    [a], [b] = await first, await second
    assert a.error is None and a.output_ids == await reference(garbled)
    assert b.error is None and b.output_ids == await reference(urgent), b.error
    assert eng.metrics()["failures"] == {"checksum": 1}
    assert free_pages_not_finite(eng) == []
    faults.disarm()
    await finish(eng)


@pytest.mark.asyncio
async def test_a_request_aborted_while_its_garbled_take_on_verifies_leaves_its_tail_zeroed():
    """The same tail, its request aborted (a client gone) after its forward ran, before the checksums failed: ended
    there, it gave the pages back as they were, and the next request on them failed on NaN."""
    eng, faults, garbled, batches = await garbled_take_on([300, 301, 302])
    req = eng.add_request(garbled, SamplingParams(max_tokens=4))
    await until(lambda: req.overlap_op is not None and eng.stats["batches"] > batches)  # (its forward ran)
    assert await eng.abort(req.rid)
    urgent = [100, 200]
    [b] = await eng.generate_async([urgent], SamplingParams(max_tokens=4, priority=-1))
    await eng.cache.drain()
    assert req.finish_reason == "abort"
    assert b.error is None and b.output_ids == await reference(urgent), b.error
    assert eng.metrics()["failures"] == {"checksum": 1}
    assert free_pages_not_finite(eng) == []
    faults.disarm()
    await finish(eng)

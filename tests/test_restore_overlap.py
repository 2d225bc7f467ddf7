"""Restores that overlap the tail forward (hicache/layer_copy.py, Admission._admit_overlapped).

An L2 restore is copied in layer order straight into the request's L1 pages and the request's
tail forward is launched at once, each layer waiting (on the device) for its own layer's copy. On
the CPU the copies are synchronous, so these tests check what does not depend on timing: the copy
plan moves exactly the right bytes, the engine takes the overlapped path, its output equals a
recompute, and a failed restore or a lost publication race discards the forward's output and
recomputes with every tier's accounting whole.
"""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from hicache.faults import Fault, FaultInjector
from hicache.geometry import KVGeometry
from hicache.layer_copy import MAX_LAYER_RUNS, layer_plan, page_runs, run_layer_cpu
from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import assert_whole, capture_op_logs
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from test_faults import OTHER, PAGE, PROMPT, REUSABLE, TransferGate, finish, make_engine, reference, run_one, until


async def _prefix_only_in_l2(eng: Engine):
    """Serve PROMPT once (its prefix is backed up to L2), then empty L1: the next request restores.
    Returns that first result."""
    first = await run_one(eng)
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    assert eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).lengths[:2] == [0, REUSABLE]
    return first


# -- the copy plan -----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_layer_plan_moves_each_page_into_its_l1_page(seed):
    rng = random.Random(seed)
    geo = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=4, page_size=2, dtype=torch.float32)
    l1_num, l2_num = 40, 30
    n = rng.randrange(1, 12)
    l1_pages, host_pages = [], []
    while len(l1_pages) < n:  # a few consecutive runs, like the allocators hand out
        run = min(n - len(l1_pages), rng.randrange(1, 5))
        a, b = rng.randrange(0, l1_num - run), rng.randrange(0, l2_num - run)
        if set(range(a, a + run)) & set(l1_pages) or set(range(b, b + run)) & set(host_pages):
            continue
        l1_pages += range(a, a + run)
        host_pages += range(b, b + run)
    kv = torch.zeros(geo.l1_shape(l1_num))
    l2 = torch.randn(geo.page_major_shape(l2_num))
    plan = layer_plan(geo, l1_num, l1_pages, host_pages)
    assert len(plan) == geo.num_layers
    for copies in plan:
        run_layer_cpu(copies, kv, l2)
    want = l2.permute(1, 2, 0, 3, 4, 5)[:, :, host_pages]  # L1 order [2, L, n, S, H, D]
    assert torch.equal(kv[:, :, l1_pages], want)
    untouched = sorted(set(range(l1_num)) - set(l1_pages))
    assert not kv[:, :, untouched].any()


def test_layer_plan_is_in_layer_order_and_refuses_fragmented_pages():
    geo = KVGeometry(num_layers=4, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.bfloat16)
    plan = layer_plan(geo, 64, [5, 6, 7, 20], [0, 1, 2, 3])
    slab = geo.slab_elements * geo.itemsize
    assert page_runs([5, 6, 7, 20], [0, 1, 2, 3]) == [(0, 3), (3, 4)]
    for layer, copies in enumerate(plan):  # K runs then V runs; every source is inside this layer's slabs
        assert [c.height for c in copies] == [3, 1, 3, 1]
        assert {(c.src_offset_bytes % geo.bytes_per_page) // slab for c in copies} == {layer, geo.num_layers + layer}
    pages = list(range(0, 4 * (MAX_LAYER_RUNS + 1), 4))  # every page its own run
    assert layer_plan(geo, 64, pages, list(range(len(pages)))) is None
    with pytest.raises(ValueError):
        layer_plan(geo, 64, [1, 2], [1])


# -- through the engine ------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_overlapped_restore_equals_recompute_and_keeps_accounting_whole():
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    assert (await _prefix_only_in_l2(eng)).output_ids == want
    with capture_op_logs() as logs:
        result = await run_one(eng)
    assert result.output_ids == want
    assert result.cached_tokens["l2"] == REUSABLE
    assert eng.stats["restore_overlaps"] == 1
    starts = [e for e in logs if e.get("state") == "prefill_start" and e.get("restore_overlap")]
    assert len(starts) == 1
    assert eng.metrics()["hit_tokens"]["l2"] == REUSABLE
    await eng.cache.drain()
    assert eng.cache.tree.match(PROMPT[:REUSABLE], touch=False).lengths[0] == REUSABLE  # published
    await finish(eng)


@pytest.mark.asyncio
async def test_restore_overlap_can_be_disabled():
    config = EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=PAGE,
                          restore_overlap=False).with_hicache(enable=True, policy="always")
    eng = Engine(config)
    await eng.start()
    want = await reference(PROMPT)
    await _prefix_only_in_l2(eng)
    result = await run_one(eng)
    assert result.output_ids == want and result.cached_tokens["l2"] == REUSABLE
    assert eng.stats["restore_overlaps"] == 0
    await finish(eng)


@pytest.mark.asyncio
async def test_failed_overlapped_restore_discards_the_forward_and_recomputes():
    faults = FaultInjector()
    eng = make_engine(faults)
    await eng.start()
    want = await reference(PROMPT)
    await _prefix_only_in_l2(eng)
    faults.arm(Fault.TRANSFER_RAISE)
    with capture_op_logs() as logs:
        result = await run_one(eng)
    assert result.output_ids == want
    assert eng.stats["restore_overlaps"] == 1
    assert [e["from_state"] for e in logs if e.get("event") == "op" and e["to_state"] == "FAILED"] == ["H2D_PENDING"]
    assert any(e.get("state") == "restore_overlap_discarded" for e in logs)
    assert result.cached_tokens["l2"] == 0  # recomputed
    await eng.cache.drain()
    assert_whole(eng.cache)
    assert (await run_one(eng)).output_ids == want
    await finish(eng)


@pytest.mark.asyncio
async def test_forward_whose_layer_wait_gave_up_is_discarded_and_rerun():
    """A layer wait that gave up (a flag never reached its epoch) means the tail forward may have
    read KV that had not landed: its output is dropped and the tail runs again on the restored
    pages; the request still gets the recompute output and keeps its L2 hit."""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    await _prefix_only_in_l2(eng)
    gave_up = iter([True])
    eng.runner.restore_wait_timed_out = lambda: next(gave_up, False)
    batches = eng.stats["batches"]
    result = await run_one(eng)
    assert result.output_ids == want
    assert eng.stats["restore_overlaps"] == 1 and result.cached_tokens["l2"] == REUSABLE
    assert next(gave_up, None) is None  # the wait was consulted
    assert eng.stats["restore_waits_timed_out"] == 1
    assert eng.stats["batches"] - batches == 1 + len(want)  # the discarded tail, its rerun, decode
    await eng.cache.drain()
    assert_whole(eng.cache)
    await finish(eng)


@pytest.mark.asyncio
async def test_layer_copy_that_cannot_be_enqueued_fails_the_restore_not_the_loop(monkeypatch):
    """A layer copy that raises while being enqueued fails the transfer (every flag is still
    written, so the tail forward never waits for it): the forward is discarded and recomputed."""
    import hicache.transfer_layered as transfer_mod

    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    await _prefix_only_in_l2(eng)
    real, calls = transfer_mod.run_layer_cpu, []

    def fail_on_second_layer(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("DMA refused")
        real(*args)
    monkeypatch.setattr(transfer_mod, "run_layer_cpu", fail_on_second_layer)
    with capture_op_logs() as logs:
        result = await run_one(eng)
    monkeypatch.setattr(transfer_mod, "run_layer_cpu", real)
    assert result.output_ids == want and result.cached_tokens["l2"] == 0
    assert eng.stats["restore_overlaps"] == 1
    assert any(e.get("state") == "restore_overlap_discarded" for e in logs)
    await eng.cache.drain()
    assert_whole(eng.cache)
    await finish(eng)


@pytest.mark.asyncio
async def test_abort_while_the_overlapped_restore_is_pending():
    """The forward ran; the restore has not published yet (held); an abort ends the request, the
    op is cancelled once its copy settled, and nothing leaks."""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    await _prefix_only_in_l2(eng)
    gate = TransferGate(eng, "h2d")
    task = asyncio.create_task(run_one(eng))
    await until(lambda: any(r.overlap_result is not None for r in eng.running))
    [req] = eng.running
    op = req.overlap_op
    assert op.state is OpState.H2D_PENDING
    assert await eng.abort(req.rid)
    await until(lambda: op.payload["cancel"])
    gate.release.set()
    result = await task
    assert result.finish_reason == "abort" and result.output_ids == []
    await eng.cache.drain()
    assert op.state is OpState.CANCELLED
    assert_whole(eng.cache)
    assert (await run_one(eng)).output_ids == want
    await finish(eng)


@pytest.mark.asyncio
async def test_two_overlapped_restores_of_one_prefix_race_to_publish():
    """Two requests restore the same prefix while neither has published (both held): the second
    to publish finds its pages were duplicates (freed), so its forward read pages the tree does not
    hold; it is discarded and the request runs again on the published prefix. (A request now waits
    for a restore of its prefix in flight, `OpRunner.restore_in_flight`; that is switched off here to
    stage the race, which a prefix computed beside a restore of it can still run.)"""
    eng = make_engine(num_pages=64)
    eng.cache.runner.restore_in_flight = lambda *args, **kwargs: None
    await eng.start()
    want = await reference(PROMPT)
    await _prefix_only_in_l2(eng)
    gate = TransferGate(eng, "h2d")
    with capture_op_logs() as logs:
        tasks = [asyncio.create_task(run_one(eng)) for _ in range(2)]
        await until(lambda: sum(r.overlap_result is not None for r in eng.running) == 2)
        gate.release.set()
        results = await asyncio.gather(*tasks)
    assert [r.output_ids for r in results] == [want, want]
    assert eng.stats["restore_overlaps"] == 2
    assert sum(e.get("state") == "restore_overlap_discarded" for e in logs) == 1
    await eng.cache.drain()
    assert_whole(eng.cache)
    other = await run_one(eng, OTHER)
    assert other.output_ids == await reference(OTHER)
    await finish(eng)


@pytest.mark.asyncio
async def test_overlapped_tail_forwards_teach_the_recompute_intercept():
    """Regression (session 3 GPU stress run 3): overlapped tails were not observed, the recompute model saw
    only full prefills of one length, charged their whole time per token, and counted a forward's
    fixed cost as a restore's saving: it kept restoring from an L3 slower than recompute (0.84x)."""
    eng = make_engine()
    await eng.start()
    await _prefix_only_in_l2(eng)
    gate = TransferGate(eng, "h2d")  # the op settles after the forward: the sample must not need it
    task = asyncio.create_task(run_one(eng))
    await until(lambda: any(r.overlap_result is not None for r in eng.running))
    sizes = [size for size, _ in eng.cache.cost.directions["recompute"]._samples]
    gate.release.set()
    await task
    assert eng.stats["restore_overlaps"] == 1
    assert len(PROMPT) - REUSABLE in sizes and len(PROMPT) in sizes
    await finish(eng)

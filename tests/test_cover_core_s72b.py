"""Session 72 coverage hunt, core (engine side): per-request step work and the pools' sizing whose lines no
test ran.

- (bug) a prefill step where the only request asking prompt logprobs is failed by its own logprobs read
  (`step_extras._logprobs_or_fail`), and the prompt logprobs read then raises as well: no live request asked, and
  the raise went out and crashed the loop, failing every other request of the step. The others go on now.
- L1 sized from a CUDA device's memory (`memory_plan.l1_pages_from_memory`, read through a stand-in for
  torch.cuda's memory query): in use is total less free, what this process freed given back first; and a
  file system the L3 file's directory is not on (statvfs fails) is "free space unknown": L3 is left as asked."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hicache.config import HiCacheConfig
from scheduler import memory_plan
from scheduler.config import EngineConfig
from scheduler.presets import get_preset
from scheduler.request import SamplingParams
from hicache_helpers import assert_whole, until
from test_faults import PROMPT, REUSABLE, finish, make_engine, reference, run_one
from test_raise_extras_s71 import HANG_GUARD_S, fault_spares_the_others, make, patch
from test_restore_overlap import _prefix_only_in_l2


@pytest.mark.asyncio
async def test_prompt_logprobs_read_raising_after_its_only_asker_failed_spares_the_others(monkeypatch):
    """The culprit asks logprobs (3) and prompt logprobs: its logprobs read raises (it fails alone), and the step's
    prompt logprobs read raises too: it belongs to no live request, so nothing more fails (regression: the loop
    crashed)."""
    eng = make()
    params = [SamplingParams(max_tokens=8, logprobs=3, prompt_logprobs=2)] + [SamplingParams(max_tokens=8)] * 2

    def inject():
        undos = [patch(monkeypatch, eng.runner, "logprobs_of", lambda handle, wants: wants is not None and 3 in wants),
                 patch(monkeypatch, eng.runner, "prompt_logprobs_of", lambda handle, wants: wants is not None)]
        return lambda: [undo() for undo in undos]
    await fault_spares_the_others(eng, params, inject, "reading this request's logprobs")


def test_l1_sized_from_a_cuda_devices_memory_counts_total_less_free_as_in_use(monkeypatch):
    """What the CPU tests cannot reach: the memory query of `plan_pools` on CUDA with no size given. The cache this
    process freed is emptied before the read (it would read as in use)."""
    gib, calls = memory_plan.GIB, []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: calls.append("read") or (60 * gib, 80 * gib))
    model = get_preset("qwen3-8b")
    geometry = model.kv_geometry(16, torch.bfloat16)
    cfg = EngineConfig(max_total_tokens=0, gpu_memory_fraction=0.9).with_hicache(enable=False)
    pages, hc = memory_plan.plan_pools(cfg, torch.device("cuda", 0), model, geometry, "qwen3-8b")
    assert calls == ["empty", "read"] and not hc.enable
    assert pages == memory_plan.l1_budget_pages(cfg, model, geometry, 80 * gib, 20 * gib)
    assert pages == (int(0.9 * 80 * gib) - 20 * gib - memory_plan.activation_reserve_bytes(model, cfg, 2)) \
        // geometry.bytes_per_page


def test_an_l3_file_on_no_readable_file_system_is_left_as_asked(tmp_path):
    hc = HiCacheConfig(enable=True, storage_path=str(tmp_path / "gone" / "deeper" / "l3.bin"))
    assert memory_plan.disk_free_bytes(hc) is None
    assert memory_plan.storage_config_within_disk(hc, 100, 4096, memory_plan.disk_free_bytes(hc)) is hc
    assert memory_plan.disk_free_bytes(HiCacheConfig(enable=True, storage_path=str(tmp_path / "l3.bin"))) > 0


@pytest.mark.asyncio
async def test_an_overlapped_restore_done_by_the_end_of_its_forward_is_adopted_at_once(monkeypatch):
    """The forward behind a layer-ordered L2 restore comes back after the restore published (on a GPU, the usual
    order; on the CPU the forward's collect is held here until then): its token is taken at once (the tail is not
    computed again), the output equals a recompute, and the L2 hit is counted once."""
    eng = make_engine()
    await eng.start()
    want = await reference(PROMPT)
    await _prefix_only_in_l2(eng)
    real_collect, real_launch, prefills = eng.runner.collect, eng.runner.launch, []

    def launch(batch, *a, **kw):
        prefills.append(batch.new_lens) if not batch.is_decode else None
        return real_launch(batch, *a, **kw)

    async def collect(handle):
        ids = await real_collect(handle)
        ops = [r.overlap_op for r in eng.running if r.overlap_op is not None]
        await until(lambda: all(op.done for op in ops))
        return ids
    monkeypatch.setattr(eng.runner, "collect", collect)
    monkeypatch.setattr(eng.runner, "launch", launch)
    result = await asyncio.wait_for(run_one(eng), HANG_GUARD_S)
    assert len(prefills) == 1, f"the tail's forward ran again: {prefills}"
    assert result.output_ids == want and result.cached_tokens["l2"] == REUSABLE
    assert eng.stats["restore_overlaps"] == 1 and eng.metrics()["hit_tokens"]["l2"] == REUSABLE
    assert not any(r.overlap_result is not None for r in eng.running)
    await eng.cache.drain()
    assert_whole(eng.cache)
    await finish(eng)

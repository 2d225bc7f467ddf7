"""Session 72 coverage hunt, core: guards no test ran, each pinned with what it refuses and says.

- An Engine started in a process forked from the one that built it refuses (its copy threads and L3 file are the
  builder's: it hung), and starts nothing; in the builder it still serves.
- A loop crash fails each live request once: one already ended is left as it is (no second last event, no second
  count).
- A checkpoint path that is not a directory, or a shard that cannot be read, is a CheckpointError naming it.
- AttentionBatch.build refuses per-sequence lists of unequal lengths; the page copy kernels refuse 2-D page ids; the
  fused q/k-norm + RoPE kernel refuses a head_dim that is not a power of two (the model never asks it to:
  scheduler/model.py takes the fused path only then).
- The skinny GEMM's block config fits its pipeline stages in a smaller shared-memory budget (a GPU with less shared
  memory a block than the H200) by halving the K block."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from kernels import fused_ops, page_copy, skinny_gemm
from scheduler.attention import AttentionBatch
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.loader import CheckpointError, checkpoint_identity, load_checkpoint
from scheduler.loop_task import fail_live_requests
from scheduler.request import RequestState, SamplingParams

HANG_GUARD_S = 20


@pytest.mark.asyncio
async def test_an_engine_in_a_forked_process_refuses_to_start(monkeypatch):
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    builder = eng._pid
    monkeypatch.setattr(eng, "_pid", builder + 1)  # (what a fork makes of it: os.getpid() is the child's)
    with pytest.raises(RuntimeError, match="built in another process .* forked from it"):
        await eng.start()
    assert eng._loop_task is None
    monkeypatch.setattr(eng, "_pid", builder)
    [out] = await asyncio.wait_for(eng.generate_async([[1, 2, 3]], SamplingParams(max_tokens=2)), HANG_GUARD_S)
    assert out.finish_reason == "length"
    await eng.shutdown()


def test_a_loop_crash_fails_each_live_request_once():
    ended = SimpleNamespace(rid="a", state=RequestState.FINISHED)
    live = SimpleNamespace(rid="b", state=RequestState.DECODE)
    finished = []
    engine = SimpleNamespace(requests={"a": ended, "b": live},
                             finish=lambda req, state, reason, error: finished.append((req.rid, state, error)))
    fail_live_requests(engine, RuntimeError("boom"))
    assert finished == [("b", RequestState.FAILED, "engine loop crashed: RuntimeError('boom')")]


def test_a_checkpoint_that_is_not_a_directory_or_cannot_be_read_is_named(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a directory")
    for call in (lambda p: load_checkpoint(p, "cpu", torch.float32), checkpoint_identity):
        with pytest.raises(CheckpointError, match=f"checkpoint {str(weights)!r} is not a directory"):
            call(weights)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({}))
    (ckpt / "shard.safetensors").mkdir()  # (a directory the glob lists: reading it raises IsADirectoryError)
    with pytest.raises(CheckpointError, match="cannot read .*shard.safetensors"):
        checkpoint_identity(ckpt)


def test_kernel_and_attention_input_guards():
    with pytest.raises(ValueError, match="must be non-empty and of equal length"):
        AttentionBatch.build([0, 0], [1], [[0], [1]], 4, "cpu", False)
    with pytest.raises(ValueError, match="must be non-empty and of equal length"):
        AttentionBatch.build([], [], [], 4, "cpu", False)
    l1 = torch.zeros(2, 1, 4, 2, 1, 8)
    with pytest.raises(ValueError, match=r"page_ids must be 1-D, got shape \(1, 2\)"):
        page_copy.gather_pages(l1, torch.tensor([[0, 1]]), torch.zeros(2, 1, 2, 2, 1, 8), "torch")
    qkv = torch.zeros(1, 3 * 96)
    cache = torch.zeros(4, 1, 96)
    with pytest.raises(ValueError, match="head_dim must be a power of two for the fused kernel, got 96"):
        fused_ops.qk_norm_rope_kv_triton(qkv, None, None, 1e-6, None, None, None, cache, cache, None, 1, 1)


@pytest.mark.parametrize("budget, block_k", [(skinny_gemm.SHARED_BYTES, 256), (32 << 10, 128), (16 << 10, 64)])
def test_the_skinny_gemm_fits_its_stages_in_a_smaller_shared_memory_budget(budget, block_k):
    """o_proj of the 8B shape in bf16: 256-wide K blocks of (32 + 16) rows, halved until two stages fit."""
    cfg = skinny_gemm._config(2048, 4096, False, 2, budget=budget)
    stage = (cfg["BLOCK_N"] + skinny_gemm.BLOCK_M) * cfg["BLOCK_K"] * 2
    assert cfg["BLOCK_K"] == block_k and 2 <= cfg["num_stages"] and cfg["num_stages"] * stage <= budget

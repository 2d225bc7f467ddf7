"""Fused layer kernels (Triton under the interpreter) against their torch references, and the fused
model path against the plain one: same K/V in the pool, same logits (float32)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import fused_ops  # noqa: E402
from scheduler.attention import AttentionBatch  # noqa: E402
from scheduler.model import Qwen3Model, init_random_weights  # noqa: E402
from scheduler.presets import PRESETS  # noqa: E402


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("hidden,with_residual", [(64, True), (48, True), (40, False)])
def test_add_rms_norm(hidden, with_residual):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g)
    res = torch.randn(5, hidden, generator=g) if with_residual else None
    w = torch.randn(hidden, generator=g)
    y, s = fused_ops.add_rms_norm_triton(x, res, w, 1e-6)
    y_ref, s_ref = fused_ops.add_rms_norm_torch(x, res, w, 1e-6)
    close(y, y_ref)
    close(s, s_ref)


@pytest.mark.parametrize("parts,with_residual,dtype", [(2, True, torch.float32), (3, False, torch.float32),
                                                      (2, True, torch.bfloat16)])
def test_add_rms_norm_adds_split_k_partials(parts, with_residual, dtype):
    """x as a split-K projection's float32 partials [P, T, H]: their sum, rounded to the model's
    dtype, is what gets added and normalised."""
    g = torch.Generator().manual_seed(parts)
    x = torch.randn(parts, 5, 64, generator=g)
    res = torch.randn(5, 64, generator=g).to(dtype) if with_residual else None
    w = torch.randn(64, generator=g).to(dtype)
    y, s = fused_ops.add_rms_norm_triton(x, res, w, 1e-6)
    y_ref, s_ref = fused_ops.add_rms_norm_torch(x.sum(0).to(dtype), res, w, 1e-6)
    assert y.shape == s.shape == (5, 64) and y.dtype == s.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    close(s.float(), s_ref.float(), tol)
    close(y.float(), y_ref.float(), tol)


@pytest.mark.parametrize("parts,with_residual", [(1, True), (1, False), (2, True)])
def test_add_rms_norm_reads_only_the_given_rows(parts, with_residual):
    """rows [B]: the forward's last rows, gathered by the norm itself (no index_select before it):
    the same values as norming every row and picking those, in the order given."""
    g = torch.Generator().manual_seed(7 + parts)
    x = torch.randn(parts, 6, 64, generator=g) if parts > 1 else torch.randn(6, 64, generator=g)
    res = torch.randn(6, 64, generator=g) if with_residual else None
    w = torch.randn(64, generator=g)
    rows = torch.tensor([5, 0, 3])
    y, s = fused_ops.add_rms_norm_triton(x, res, w, 1e-6, rows=rows)
    y_all, s_all = fused_ops.add_rms_norm_triton(x, res, w, 1e-6)
    assert y.shape == s.shape == (3, 64)
    assert torch.equal(y, y_all[rows]) and torch.equal(s, s_all[rows])


def test_first_layer_norm_gathers_the_embeddings():
    """Layer 0's norm reads the input ids' rows of the embedding table itself (no embedding kernel
    before it): the stream it returns is the embeddings, its output their norm."""
    g = torch.Generator().manual_seed(3)
    table, w = torch.randn(50, 64, generator=g), torch.randn(64, generator=g)
    ids = torch.tensor([7, 49, 0, 7])
    y, s = fused_ops.add_rms_norm_triton(table, None, w, 1e-6, rows=ids)
    y_ref, s_ref = fused_ops.add_rms_norm_torch(table[ids], None, w, 1e-6)
    close(y, y_ref)
    assert torch.equal(s, table[ids])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 3), (2, 2)])
def test_qk_norm_rope_kv(num_heads, num_kv_heads):
    g = torch.Generator().manual_seed(num_heads)
    d, page_size, pages, tokens = 16, 4, 6, 5
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * d, generator=g)
    qw, kw = torch.randn(d, generator=g), torch.randn(d, generator=g)
    angles = torch.randn(32, d // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [N, D]
    positions = torch.tensor([0, 3, 9, 31, 12])
    slots = torch.tensor([5, 0, 23, 11, 6])
    caches = [torch.zeros(pages, page_size, num_kv_heads, d) for _ in range(4)]
    q = fused_ops.qk_norm_rope_kv_triton(qkv, qw, kw, 1e-6, cos, sin, positions, caches[0], caches[1], slots,
                                         num_heads, num_kv_heads)
    q_ref = fused_ops.qk_norm_rope_kv_torch(qkv, qw, kw, 1e-6, cos, sin, positions, caches[2], caches[3], slots,
                                            num_heads, num_kv_heads)
    close(q, q_ref)
    close(caches[0], caches[2])
    close(caches[1], caches[3])
    untouched = torch.ones(pages * page_size, dtype=torch.bool)
    untouched[slots] = False
    assert caches[0].view(-1, num_kv_heads, d)[untouched].abs().sum() == 0


def test_silu_mul():
    x = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(3))
    close(fused_ops.silu_mul_triton(x), fused_ops.silu_mul_torch(x))


def test_fused_model_equals_plain_model():
    """Prefill with a cached prefix, then a decode step: logits and the pool agree between paths."""
    cfg = PRESETS["tiny"]
    model = init_random_weights(Qwen3Model.empty(cfg, "cpu", torch.float32), seed=0)
    page_size = 4
    pools = [torch.zeros(cfg.kv_geometry(page_size, torch.float32).l1_shape(16)) for _ in range(2)]
    tables = [[3, 7, 1, 9], [2, 5, 11, 0]]
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    steps = [  # (prefix_lens, new_lens, is_decode, input rows)
        ([0, 0], [6, 5], False, ids[:11]),
        ([6, 5], [3, 1], False, ids[11:15]),
        ([9, 6], [1, 1], True, ids[15:17]),
    ]
    for prefix, new, is_decode, step_ids in steps:
        logits = []
        for fused, pool in zip((False, True), pools):
            model.fused = fused
            batch = AttentionBatch.build(prefix, new, tables, page_size, "cpu", is_decode)
            logits.append(model(step_ids, batch, pool))
        close(logits[1], logits[0], 1e-4)
        close(pools[1], pools[0], 1e-5)
    model.fused = False



@pytest.mark.parametrize("split_k", [1, 2])
def test_skinny_projections_equal_cublas_path(split_k, monkeypatch):
    """The fused layer with its projections by kernels/skinny_gemm.py (forwards of <= 16 rows; SiLU
    inside gate_up's kernel; o_proj and down as K-split partials that the norms add up, which the
    8B shape gets) against nn.Linear + the SiLU kernel: same logits and K/V (float32)."""
    from kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "split_k_for", lambda n, k: split_k)
    cfg = PRESETS["tiny"]
    model = init_random_weights(Qwen3Model.empty(cfg, "cpu", torch.float32), seed=0)
    model.fused = True
    page_size = 4
    pools = [torch.zeros(cfg.kv_geometry(page_size, torch.float32).l1_shape(16)) for _ in range(2)]
    tables = [[3, 7, 1, 9], [2, 5, 11, 0]]
    ids = torch.randint(0, cfg.vocab_size, (14,), generator=torch.Generator().manual_seed(1))
    try:
        for prefix, new, is_decode, step_ids in [([0, 0], [6, 5], False, ids[:11]),
                                                 ([6, 5], [1, 1], True, ids[11:13])]:
            logits = []
            for skinny, pool in zip((False, True), pools):
                model.skinny = skinny
                logits.append(model(step_ids, AttentionBatch.build(prefix, new, tables, page_size, "cpu", is_decode),
                                    pool))
            close(logits[1], logits[0], 1e-5)
            close(pools[1], pools[0], 1e-5)
    finally:
        model.fused = model.skinny = False


def test_fp32_lm_head_flag_reaches_the_model_and_is_a_cuda_path_only():
    """--disable-fp32-lm-head reaches the model; off CUDA (and for float32 weights) logits_of stays the
    model-dtype product cast to float32, whatever the flag (torch's float32-output mm is CUDA only)."""
    import argparse

    import torch.nn.functional as F

    from scheduler.config import EngineConfig, add_engine_args, config_from_args
    from scheduler.engine import Engine

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).fp32_lm_head is True
    assert config_from_args(parser.parse_args(["--disable-fp32-lm-head"])).fp32_lm_head is False
    assert Engine(EngineConfig(model="tiny", device="cpu", num_pages=32)).model.fp32_lm_head is True
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=32, dtype="bfloat16", fp32_lm_head=False))
    model = eng.model
    assert model.fp32_lm_head is False
    hidden = torch.randn(3, model.cfg.hidden_size, dtype=torch.bfloat16)
    want = F.linear(hidden, model.lm_head_weight).float()
    for flag in (False, True):
        model.fp32_lm_head = flag
        got = model.logits_of(hidden)
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_small_gemm_backend_is_validated_and_reaches_the_model():
    import argparse

    from scheduler.config import EngineConfig, add_engine_args, config_from_args
    from scheduler.engine import Engine

    with pytest.raises(ValueError, match="small_gemm"):
        EngineConfig(small_gemm="cutlass")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--small-gemm", "cublas"])).small_gemm == "cublas"
    assert config_from_args(parser.parse_args([])).small_gemm == EngineConfig.small_gemm
    with pytest.raises(SystemExit):
        parser.parse_args(["--small-gemm", "cutlass"])
    assert not Engine(EngineConfig(model="tiny", device="cpu", num_pages=32)).model.skinny  # CPU: plain torch

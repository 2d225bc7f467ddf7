"""Fused layer kernels (Triton under the interpreter) against their torch references, and the fused
model path against the plain one: same K/V in the pool, same logits (float32)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import fused_ops  # noqa: E402
from scheduler.attention import AttentionBatch  # noqa: E402
from scheduler.model import Qwen3Model, init_random_weights, layer_spans  # noqa: E402
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


@pytest.mark.parametrize("num_layers", [1, 2, 5, 36])
def test_layer_spans_cover_every_layer_once_shortest_first(num_layers):
    for pieces in range(1, num_layers + 3):
        spans = layer_spans(num_layers, pieces)
        assert len(spans) == min(pieces, num_layers)
        assert spans[0][0] == 0 and spans[-1][1] == num_layers
        assert all(a < b for a, b in spans) and all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
        assert spans[0][1] - spans[0][0] == min(b - a for a, b in spans)  # the launch the device waits for
    with pytest.raises(ValueError, match="pieces"):
        layer_spans(num_layers, 0)


@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_forward_pieces_chained_equal_forward(pieces):
    """What each CUDA graph piece runs (scheduler/cuda_graphs.ForwardGraph), chained on the CPU: the
    same logits and the same K/V as one forward, for a prefill with a cached prefix and a decode."""
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
            batch = AttentionBatch.build(prefix, new, tables, page_size, "cpu", is_decode)
            whole = model(step_ids, batch, pools[0])
            parts = model.forward_pieces(step_ids, batch, pools[1], pieces=pieces)
            assert len(parts) == min(pieces, cfg.num_layers)
            state = None
            for part in parts:
                state = part(state)
            close(state, whole, 1e-6)
            close(pools[1], pools[0], 1e-6)
    finally:
        model.fused = False


def test_graph_pieces_are_validated_and_reach_the_config():
    import argparse

    from scheduler.config import EngineConfig, add_engine_args, config_from_args

    with pytest.raises(ValueError, match="cuda_graph_pieces"):
        EngineConfig(cuda_graph_pieces=0)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--cuda-graph-pieces", "4"])).cuda_graph_pieces == 4
    assert config_from_args(parser.parse_args([])).cuda_graph_pieces == EngineConfig.cuda_graph_pieces

"""scripts/probe_graph_ab.py off the GPU: its variants patch what they say and put it back, and the
embedding-kernel variant computes what the engine's forward does."""
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import probe_graph_ab as probe  # noqa: E402
from kernels import decode_attention, fused_ops, pdl, skinny_gemm  # noqa: E402
from scheduler.attention import AttentionBatch  # noqa: E402
from scheduler.model import Qwen3Model, init_random_weights  # noqa: E402
from scheduler.presets import PRESETS  # noqa: E402


def _state():
    return (decode_attention.pdl, decode_attention.TAIL_PDL, decode_attention.SPREAD_SPLITS, skinny_gemm.pdl,
            fused_ops.pdl, pdl._enabled, fused_ops.add_rms_norm_triton, skinny_gemm._skinny_kernel)


@pytest.mark.parametrize("variant", list(probe.VARIANTS))
def test_each_variant_is_undone_on_exit(variant, monkeypatch):
    monkeypatch.setattr(pdl, "_enabled", True)  # (as on a GPU without HICACHE_PDL=0)
    before = _state()
    with probe.VARIANTS[variant]():
        assert _state() != before
    assert _state() == before


def test_pdl_off_variants_launch_the_ordinary_way():
    with probe.VARIANTS["pdl_off_attn"]():
        assert decode_attention.pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}
    with probe.VARIANTS["pdl_off_tail_attn"]():
        assert decode_attention.TAIL_PDL is False
    with probe.VARIANTS["unspread"]():
        assert decode_attention.SPREAD_SPLITS is False


def test_embedding_kernel_variant_computes_the_same_forward(monkeypatch):
    """... by an embedding kernel of its own (F.embedding), which the engine's forward never calls."""
    calls = []
    embedding = torch.nn.functional.embedding
    monkeypatch.setattr(torch.nn.functional, "embedding", lambda *a, **k: calls.append(1) or embedding(*a, **k))
    cfg = PRESETS["tiny"]
    model = init_random_weights(Qwen3Model.empty(cfg, "cpu", torch.float32), seed=0)
    model.fused = True
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(1))
    logits = []
    for variant in (None, "embed_kernel"):
        pool = torch.zeros(cfg.kv_geometry(4, torch.float32).l1_shape(16))
        batch = AttentionBatch.build([0], [6], [[3, 7]], 4, "cpu", False)
        if variant is None:
            logits.append(model(ids, batch, pool))
            assert calls == []
        else:
            with probe.VARIANTS[variant]():
                logits.append(model(ids, batch, pool))
            assert calls == [1]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_unknown_variant_is_an_error():
    with pytest.raises(SystemExit):
        probe.main(["--variants", "engine,faster"])


def test_first_row_variant_computes_the_first_row_only():
    """skinny_first_row: row 0 as the real projection, the other rows never written."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 32, generator=gen), torch.randn(48, 32, generator=gen)
    with probe.VARIANTS["skinny_first_row"]():
        y = skinny_gemm.linear(x, w)
    torch.testing.assert_close(y[0], x[0] @ w.T)
    assert not torch.allclose(y[1:], x[1:] @ w.T)

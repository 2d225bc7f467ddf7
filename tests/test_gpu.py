"""GPU-only checks (skipped without CUDA): CUDA graphs and the Triton decode kernel give the same
greedy outputs as eager execution, and restores through the real DMA path equal recompute."""
import random

import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.request import SamplingParams

pytestmark = pytest.mark.gpu


def prompts(n=6, base=60, seed=0):
    rng = random.Random(seed)
    b = [rng.randrange(512) for _ in range(base)]
    return [b + [rng.randrange(512) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def run(cfg, ps, max_tokens=8):
    from scheduler.engine import Engine
    eng = Engine(cfg)
    out = [r.output_ids for r in eng.generate(ps, SamplingParams(max_tokens=max_tokens))]
    eng.check_integrity()
    return out, eng


def test_graphs_equal_eager():
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16,
                        cuda_graphs=True)
    ps = prompts()
    eager, _ = run(EngineConfig(**{**base.__dict__, "cuda_graphs": False}), ps)
    graphs, eng = run(base, ps)
    assert eng.runner.graphs is not None
    assert graphs == eager


@pytest.mark.parametrize("tier", ["l2", "l3"])
def test_restores_equal_recompute_on_gpu(tier):
    rng = random.Random(1)
    bases = [[rng.randrange(512) for _ in range(64)] for _ in range(4)]  # L1 holds about two
    ps = [bases[i % 4] + [rng.randrange(512)] for i in range(16)]
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=12, page_size=16,
                        max_running_requests=1)
    ref, _ = run(EngineConfig(**{**base.__dict__, "num_pages": 1024, "enable_prefix_cache": False}), ps)
    cfg = base.with_hicache(enable=True, policy="always", host_ratio=4.0 if tier == "l2" else 1.0,
                            storage_ratio=0.0 if tier == "l2" else 8.0)
    out, eng = run(cfg, ps)
    assert out == ref
    assert eng.metrics()["hit_tokens"][tier] > 0
    assert torch.cuda.is_available()


def test_fused_kernels_equal_plain_torch():
    """The fused Triton layer (default on CUDA) against the plain torch layer: same greedy outputs."""
    from scheduler.engine import Engine
    cfg = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16)
    ps = prompts(seed=3)
    fused, eng = run(cfg, ps)
    assert eng.model.fused
    plain_eng = Engine(cfg)
    plain_eng.model.fused = False
    plain = [r.output_ids for r in plain_eng.generate(ps, SamplingParams(max_tokens=8))]
    assert fused == plain


def test_tail_graph_equals_eager():
    """Prompts whose cached prefix leaves 2..16 tokens replay the tail graph (16 rows per sequence)."""
    rng = random.Random(5)
    base = [rng.randrange(512) for _ in range(64)]
    ps = [base + [rng.randrange(512) for _ in range(k)] for k in (1, 2, 5, 9, 15)]
    cfg = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16,
                       cuda_graphs=True, max_running_requests=1)
    eager, _ = run(EngineConfig(**{**cfg.__dict__, "cuda_graphs": False}), [base] + ps)
    graphs, eng = run(cfg, [base] + ps)
    assert any(s[1] > 1 for s in eng.runner.graphs.graphs)
    assert graphs == eager


def test_prefill_graphs_equal_eager():
    """Fresh one-sequence prefills of 17..512 tokens replay a graph padded to 64-token buckets."""
    rng = random.Random(9)
    ps = [[rng.randrange(512) for _ in range(n)] for n in (17, 63, 64, 65, 300, 512, 513)]
    cfg = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16,
                       cuda_graphs=True, max_running_requests=1, enable_prefix_cache=False)
    eager, _ = run(EngineConfig(**{**cfg.__dict__, "cuda_graphs": False}), ps)
    graphs, eng = run(cfg, ps)
    assert eng.runner.graphs.prefill_graphs
    assert graphs == eager

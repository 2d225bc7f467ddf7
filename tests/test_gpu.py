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


@pytest.mark.parametrize("tier,overlap,graphs,kernel_tokens", [
    ("l2", True, True, 1024), ("l2", True, True, 0), ("l2", True, False, 1024), ("l2", False, True, 1024),
    ("l3", True, True, 1024)])
def test_restores_equal_recompute_on_gpu(tier, overlap, graphs, kernel_tokens, monkeypatch):
    """kernel_tokens: restores up to this long by the copy kernel (the default), 0: by 2-D DMAs
    (the tiny model's 2 KiB slabs would take the kernel anyway: allowed 2-D DMAs here)."""
    if kernel_tokens == 0:
        monkeypatch.setattr("hicache.transfer.MIN_DMA_ROW_BYTES", 0)
    rng = random.Random(1)
    bases = [[rng.randrange(512) for _ in range(64)] for _ in range(4)]  # L1 holds about two
    ps = [bases[i % 4] + [rng.randrange(512) for _ in range(1 + i % 3)] for i in range(16)]
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=12, page_size=16,
                        max_running_requests=1, restore_overlap=overlap, cuda_graphs=graphs)
    ref, _ = run(EngineConfig(**{**base.__dict__, "num_pages": 1024, "enable_prefix_cache": False}), ps)
    cfg = base.with_hicache(enable=True, policy="always", host_ratio=4.0 if tier == "l2" else 1.0,
                            storage_ratio=0.0 if tier == "l2" else 8.0, kernel_restore_max_tokens=kernel_tokens)
    out, eng = run(cfg, ps)
    assert out == ref
    assert eng.metrics()["hit_tokens"][tier] > 0
    assert (eng.stats["restore_overlaps"] > 0) == overlap  # an L3 hit is prefetched to L2, then restored from there
    assert eng.stats["restore_waits_timed_out"] == 0  # every layer wait saw its copy land


def test_one_token_pages_restore_by_the_copy_kernel_at_any_length():
    """Regression: with one-token pages (2 KiB slabs of the 8B shape) a restore longer than
    --hicache-kernel-restore-max-tokens took 2-D DMAs of 2 KiB rows (10-18 GiB/s on the H200), and
    the kernel moved one slab an item. Now such a restore takes the kernel at any length, 8 slabs an
    item, and lands byte for byte with every layer's flag at its epoch; a backup's first pages are
    gathered like the rest (no 2-D DMAs of 2 KiB rows)."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=1, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 1200, torch.device("cuda")), HostPool(geo, 1100, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "triton"), kernel_max_pages=0)
    assert te.narrow_slabs and te.direct_pages == 0 and te.host_copy.rows == 8
    l2.page_buffer.view(torch.int16).random_(1, 1000)
    host, dev = list(range(50, 1050)), random.Random(2).sample(range(1200), 1000)
    tr = te.h2d_layerwise(host, dev)
    assert tr is not None and tr.keepalive  # the kernel's page list, not a DMA plan
    te.wait_blocking(tr)
    assert not tr.fail
    assert torch.equal(l1.kv[:, :, dev].cpu(), l2.buffer[:, :, host])
    assert te.layer_flags.flags.tolist() == [tr.epoch] * 36
    l2.page_buffer.zero_()
    tr = te.d2h(dev[:500], list(range(500)))
    te.wait_blocking(tr)
    assert torch.equal(l2.buffer[:, :, :500], l1.kv[:, :, dev[:500]].cpu())
    te.close()


def test_one_token_pages_restores_equal_recompute_on_gpu():
    """The engine at page size 1, every restore by the copy kernel (kernel_restore_max_tokens 0:
    the narrow slabs alone route them there): outputs equal recompute, every layer wait satisfied."""
    rng = random.Random(4)
    bases = [[rng.randrange(512) for _ in range(61)] for _ in range(4)]
    ps = [bases[i % 4] + [rng.randrange(512)] for i in range(12)]
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=140, page_size=1,
                        max_running_requests=1, cuda_graphs=True)
    ref, _ = run(EngineConfig(**{**base.__dict__, "num_pages": 4096, "enable_prefix_cache": False}), ps)
    out, eng = run(base.with_hicache(enable=True, policy="always", host_ratio=4.0, storage_ratio=0.0,
                                     kernel_restore_max_tokens=0), ps)
    assert out == ref
    assert eng.metrics()["hit_tokens"]["l2"] >= 6 * 61
    assert eng.stats["restore_overlaps"] > 0 and eng.stats["restore_waits_timed_out"] == 0
    assert eng.cache.transfer.narrow_slabs


@pytest.mark.parametrize("captured,fragmented", [(True, False), (False, False), (True, True), (False, True)])
def test_layer_flags_hold_each_layer_until_its_copy_landed(captured, fragmented):
    """A layer-ordered restore of 288 MiB (several ms over PCIe) and, right behind it, work that
    reads each layer after waiting for that layer's flag (inside a captured graph, with the epoch
    staged in a device tensor; or eagerly): every layer it reads is the restored data, none the
    zeros that were there before, and no wait gives up. Fragmented: pages in random order on both
    sides, too many runs for the 2-D DMA plan, so the copy kernel reading pinned L2 moves them."""
    from hicache.geometry import KVGeometry
    from hicache.layer_copy import layer_plan
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    n = 128
    l1 = DevicePool(geo, n + 8, torch.device("cuda"))
    l2 = HostPool(geo, n, pin=True)
    l2.page_buffer.view(torch.int16).random_(1, 1000)  # no zero anywhere
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"))
    assert te.layerwise
    flags = te.layer_flags
    l1_pages, host_pages = list(range(4, 4 + n)), list(range(n))
    if fragmented:
        rng = random.Random(2)
        l1_pages, host_pages = rng.sample(range(n + 8), n), rng.sample(range(n), n)
    assert (layer_plan(geo, n + 8, l1_pages, host_pages) is None) == fragmented
    idx = torch.tensor(l1_pages, device="cuda")
    seen = torch.empty((geo.num_layers, 2, n, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    staged = torch.zeros(1, dtype=torch.int64, device="cuda")

    def read_layers():
        for layer in range(geo.num_layers):
            flags.wait(layer, staged)
            seen[layer].copy_(l1.kv[:, layer].index_select(1, idx))

    graph = None
    if captured:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            read_layers()  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            read_layers()
    for _ in range(3):
        l1.kv.zero_()
        seen.zero_()
        tr = te.h2d_layerwise(host_pages, l1_pages)
        staged.fill_(tr.epoch)
        graph.replay() if captured else read_layers()
        torch.cuda.synchronize()
        te.wait_blocking(tr)
        want = l2.buffer[:, :, host_pages].permute(1, 0, 2, 3, 4, 5).cuda()  # [L, 2, n, S, H, D]
        assert torch.equal(seen, want)
        assert not flags.timed_out()
    te.close()


def test_fragmented_transfers_reach_pinned_l2_with_the_copy_kernels():
    """A plain (not layer-ordered) H2D of host pages in random order takes the copy kernel, not a
    CPU gather, and lands byte for byte; twice in a row (the kernel's counts reset). A D2H into
    host pages in random order writes them straight (no workspace), byte for byte."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    l1 = DevicePool(geo, 80, torch.device("cuda"))
    l2 = HostPool(geo, 64, pin=True)
    l2.page_buffer.view(torch.int16).random_(1, 1000)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"))
    assert te.host_reads
    rng = random.Random(3)
    for _ in range(2):
        l1.kv.zero_()
        host_pages, l1_pages = rng.sample(range(64), 40), rng.sample(range(80), 40)
        tr = te.h2d(host_pages, l1_pages)
        assert tr.workspace is None  # no staging: the kernel reads L2 directly
        te.wait_blocking(tr)
        assert torch.equal(l1.kv[:, :, l1_pages].cpu(), l2.buffer[:, :, host_pages])
        untouched = sorted(set(range(80)) - set(l1_pages))
        assert not l1.kv[:, :, untouched].any()
    l1.kv.view(torch.int16).random_(1, 1000)
    l2.page_buffer.zero_()
    host_pages, l1_pages = rng.sample(range(64), 40), rng.sample(range(80), 40)
    tr = te.d2h(l1_pages, host_pages)
    assert tr.workspace is None and tr.finish is None
    te.wait_blocking(tr)
    assert torch.equal(l2.buffer[:, :, host_pages], l1.kv[:, :, l1_pages].cpu())
    assert not l2.page_buffer[sorted(set(range(64)) - set(host_pages))].any()
    te.close()


@pytest.mark.parametrize("kind", ["pipelined", "whole", "layerwise", "kernel"])
def test_a_transfer_behind_a_busy_callers_stream_counts_that_wait_apart(kind):
    """Enqueued while a ~50 ms kernel still runs on the caller's stream, every kind of transfer
    waits for it; the wait is measured as compute_wait_ns (on the device clock, from enqueue to the
    caller's work done) and left out of its recurring time, which stays about its own service."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 64, torch.device("cuda")), HostPool(geo, 64, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"), kernel_max_pages=8 if kind == "kernel" else 0,
                        min_dma_row_bytes=0)  # 4 KiB slabs: 2-D DMAs all the same
    pages = {"pipelined": 16, "whole": 4, "layerwise": 16, "kernel": 4}[kind]
    host, dev = list(range(pages)), list(range(10, 10 + pages))
    enqueue = te.h2d_layerwise if kind in ("layerwise", "kernel") else te.h2d
    te.wait_blocking(enqueue(host, dev))  # warm: compile, workspaces
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms on the caller's (current) stream
    tr = te.wait_blocking(enqueue(host, dev))
    assert tr.compute_wait_ns > 20_000_000
    assert tr.recurring_ns + tr.compute_wait_ns <= tr.end_to_end_ns - tr.setup_ns
    assert tr.recurring_ns < tr.compute_wait_ns / 2
    te.close()


@pytest.mark.parametrize("kind", ["pipelined", "layerwise", "kernel"])
def test_a_transfer_seen_done_late_is_sampled_by_its_device_time(kind):
    """Regression (session 17): a restore whose completion a thread saw ~100 ms late was sampled
    as a 100 ms copy. Seen 50 ms after the device finished, a transfer's recurring time stays its
    device time; the 50 ms are its seen_wait_ns."""
    import time

    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 64, torch.device("cuda")), HostPool(geo, 64, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"), kernel_max_pages=8 if kind == "kernel" else 0,
                        min_dma_row_bytes=0)
    pages = {"pipelined": 16, "layerwise": 16, "kernel": 4}[kind]
    host, dev = list(range(pages)), list(range(10, 10 + pages))
    enqueue = te.h2d_layerwise if kind in ("layerwise", "kernel") else te.h2d
    te.wait_blocking(enqueue(host, dev))  # warm: compile, workspaces
    tr = enqueue(host, dev)
    torch.cuda.synchronize()
    time.sleep(0.05)
    te.wait_blocking(tr)
    assert tr.device_ns > 0 and tr.seen_wait_ns > 40_000_000
    assert tr.recurring_ns < 20_000_000
    te.close()


def test_a_copy_kernel_that_cannot_launch_fails_the_transfer_with_every_flag_written(monkeypatch):
    """A short restore goes by the copy kernel; if its launch raises, the transfer fails (not the
    caller) and every layer flag still reaches the epoch, so no forward waits for it."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine, TransferError
    from kernels import host_copy
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 16, torch.device("cuda")), HostPool(geo, 16, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"), kernel_max_pages=8)

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(host_copy.HostCopy, "h2d_layers", broken)
    tr = te.h2d_layerwise([0, 1, 2], [5, 6, 7])
    assert tr is not None and tr.fail
    with pytest.raises(TransferError, match="copy kernel not launched"):
        te.wait_blocking(tr)
    assert te.layer_flags.flags.tolist() == [tr.epoch] * 4
    te.close()


def test_layer_wait_gives_up_on_a_flag_never_written():
    """A wait for an epoch no copy will write returns after its spins and reports it."""
    from kernels.layer_flags import LayerFlags

    flags = LayerFlags(2, torch.device("cuda"), max_spins=1000)
    flags.signal(torch.cuda.current_stream(), 0, 5)
    flags.expected.fill_(5)
    flags.wait(0)
    assert not flags.timed_out()
    flags.expected.fill_(6)
    flags.wait(1)
    assert flags.timed_out()


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


def test_small_gemm_backends_agree():
    """Forwards of <= 16 rows (decode, tails) with projections by kernels/skinny_gemm.py (the
    default) and by cuBLAS: same greedy outputs; and the kernel in bf16 at the 8B shapes."""
    import torch.nn.functional as F

    from kernels import skinny_gemm
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16)
    ps = prompts(seed=4)
    triton_out, eng = run(base, ps)
    assert eng.model.skinny
    cublas_out, eng = run(EngineConfig(**{**base.__dict__, "small_gemm": "cublas"}), ps)
    assert not eng.model.skinny
    assert triton_out == cublas_out
    for n, k, swiglu in [(6144, 4096, False), (2 * 12288, 4096, True), (4096, 12288, False)]:
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            want = F.linear(x.float(), w.float())
            if swiglu:
                gate, up = want.chunk(2, dim=-1)
                want = F.silu(gate) * up
            got = skinny_gemm.linear(x, w, swiglu=swiglu).float()
            assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("graphs", [True, False])
def test_pdl_launches_equal_ordinary_launches(graphs):
    """Kernels launched with programmatic dependent launch (kernels/pdl.py, the default from sm_90)
    against ordinary launches: the same greedy outputs through prefills, 16-row tails, decode and
    layer-overlapped L2 restores (whose attention spins on flags set from another stream)."""
    from kernels import pdl
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs sm_90 and Triton >= 3.4")
    rng = random.Random(11)
    bases = [[rng.randrange(512) for _ in range(64)] for _ in range(4)]  # L1 holds about two
    ps = [bases[i % 4] + [rng.randrange(512) for _ in range(1 + i % 3)] for i in range(12)]
    cfg = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=12, page_size=16,
                       max_running_requests=1, cuda_graphs=graphs).with_hicache(
        enable=True, policy="always", host_ratio=4.0, storage_ratio=0.0)
    with_pdl, eng = run(cfg, ps)
    assert eng.metrics()["hit_tokens"]["l2"] > 0 and eng.stats["restore_overlaps"] > 0
    previous = pdl.set_enabled(False)
    try:
        without, _ = run(cfg, ps)
    finally:
        pdl.set_enabled(previous)
    assert with_pdl == without


def test_pdl_layer_chain_in_a_graph_is_bitwise_the_ordinary_one():
    """The 8B shape's skinny layer chain in bf16 (norm, qkv, o_proj K-split, norm adding the
    partials, gate_up with SwiGLU, down K-split, norm), captured in a CUDA graph with PDL and
    without: bitwise the same, and the same as run eagerly."""
    from kernels import fused_ops, pdl, skinny_gemm
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs sm_90 and Triton >= 3.4")
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(n, k):
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5

    qkv_w, o_w, gu_w, down_w = w(6144, 4096), w(4096, 4096), w(2 * 12288, 4096), w(4096, 12288)
    norm_w = torch.rand(4096, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, generator=g)

    def chain():
        h, res = fused_ops.add_rms_norm_triton(x, None, norm_w, 1e-6)
        qkv = skinny_gemm.linear(h, qkv_w)
        o = skinny_gemm.linear(qkv[:, :4096].contiguous(), o_w, split_k=skinny_gemm.split_k_for(4096, 4096))
        h, res = fused_ops.add_rms_norm_triton(o, res, norm_w, 1e-6)
        down = skinny_gemm.linear(skinny_gemm.linear(h, gu_w, swiglu=True), down_w,
                                  split_k=skinny_gemm.split_k_for(4096, 12288))
        return fused_ops.add_rms_norm_triton(down, res, norm_w, 1e-6)[0]

    def captured():
        chain()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    eager = chain()
    with_pdl = captured()
    previous = pdl.set_enabled(False)
    try:
        without = captured()
    finally:
        pdl.set_enabled(previous)
    assert torch.equal(with_pdl, without) and torch.equal(with_pdl, eager)


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


def _compiled_variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return sum(len(c) for c in getattr(kernel, "cache", {}).values())
    return sum(len(v[0] if isinstance(v, tuple) else v) for v in caches.values())


def test_page_copy_compiles_once_for_every_chunk():
    """Transfers are cut in chunks of any length starting at any page: after the first launch no
    chunk may compile another kernel variant (a mid-serving compile stalls a restore ~0.1 s)."""
    from kernels.page_copy import _page_copy_kernel, gather_pages_triton, scatter_pages_triton

    pool = torch.randn((2, 4, 40, 16, 8, 128), device="cuda").to(torch.bfloat16)
    idx = torch.randperm(40, device="cuda")
    packed = torch.empty((40, 2, 4, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    gather_pages_triton(pool, idx[:2], packed[:2])
    scatter_pages_triton(packed[:2], idx[:2], pool)
    before = _compiled_variants(_page_copy_kernel)
    for lo, hi in [(1, 4), (3, 16), (5, 6), (7, 40), (0, 33)]:
        gather_pages_triton(pool, idx[lo:hi], packed[lo:hi])
        scatter_pages_triton(packed[lo:hi], idx[lo:hi], pool)
    small = torch.randn((2, 4, 7, 16, 8, 128), device="cuda").to(torch.bfloat16)  # another pool size
    gather_pages_triton(small, idx[:3] % 7, packed[:3])
    torch.cuda.synchronize()
    assert _compiled_variants(_page_copy_kernel) == before


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_pipelined_transfers_move_every_chunk_exactly(backend):
    """Consecutive L2 pages go by the chunked pipeline (kernels on explicit streams, one raw DMA a
    chunk): with a 2-page first chunk, 40 pages in random L1 order are 3 chunks each way, a D2H's
    first 3 pages going straight out of L1 by 2-D DMAs (then 2 gathered chunks); D2H then H2D land
    byte for byte, twice (the second time through the cached direct launches)."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from hicache.transfer_plan import RAMP_GROWTH, ramp_chunks
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 96, torch.device("cuda")), HostPool(geo, 64, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, backend), min_dma_row_bytes=0)  # 4 KiB slabs
    te.first_chunk_pages = 2
    assert te.direct_pages > 0  # pinned L2 and the runtime's 2-D copy
    te.direct_pages = 3
    assert len(ramp_chunks(40, 2, RAMP_GROWTH)) == 3 and len(ramp_chunks(37, 6, RAMP_GROWTH)) == 2
    rng = random.Random(5)
    for _ in range(2):
        l1.kv.view(torch.int16).random_(1, 1000)
        l2.page_buffer.zero_()
        src, host_pages = rng.sample(range(96), 40), list(range(10, 50))
        tr = te.d2h(src, host_pages)
        assert tr.workspace is not None  # the gather + DMA pipeline, not a copy kernel
        te.wait_blocking(tr)
        assert torch.equal(l2.buffer[:, :, host_pages], l1.kv[:, :, src].cpu())
        assert not l2.page_buffer[:10].any() and not l2.page_buffer[50:].any()
        dst = rng.sample(range(96), 40)
        l1.kv.zero_()
        te.wait_blocking(te.h2d(host_pages, dst))
        assert torch.equal(l1.kv[:, :, dst].cpu(), l2.buffer[:, :, host_pages])
        assert not l1.kv[:, :, sorted(set(range(96)) - set(dst))].any()
    te.close()


def test_direct_launch_keeps_variants_apart():
    """A direct launch reuses a compiled variant only for arguments the JIT would have given it:
    a pointer that loses its 16-byte alignment, or an int that becomes 1, goes through the JIT
    again and gets the right result."""
    import triton
    import triton.language as tl

    from kernels.direct_launch import DirectLaunch

    @triton.jit
    def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    launch = DirectLaunch(add_one)
    stream = torch.cuda.Stream()
    x = torch.arange(64, dtype=torch.int32, device="cuda")
    for lo, n in [(0, 64), (0, 64), (1, 63), (1, 63), (4, 1), (4, 1), (0, 17)]:
        y = torch.zeros(n, dtype=torch.int32, device="cuda")
        stream.wait_stream(torch.cuda.current_stream())
        launch((triton.cdiv(n, 32),), stream, x[lo:lo + n], y, n, BLOCK=32)
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(y, x[lo:lo + n] + 1)
    assert len(launch._compiled) == 4  # aligned / misaligned pointer, n == 1, n not a multiple of 16


@pytest.mark.parametrize("flip", [False, True])
def test_l3_prefetch_taken_on_while_verifying_on_gpu(flip):
    """An L3 hit's checksums held back (SLOW_VERIFY): the request takes its prefetch on to L1
    once the read landed, the layer-ordered H2D and the tail's forward run on the device, and the
    output counts only after the checksums passed. With a flipped L3 byte the forward is
    discarded and the request recomputes; either way the output equals a plain recompute."""
    import asyncio

    from hicache.faults import Fault, FaultInjector
    from hicache.radix import Tier
    from hicache_helpers import capture_op_logs, flip_l3_byte, op_transitions
    from scheduler.engine import Engine

    rng = random.Random(2)
    prompt = [rng.randrange(512) for _ in range(64)] + [7]
    tokens = prompt[:-1]
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=12, page_size=16,
                        max_running_requests=1)
    ref, _ = run(EngineConfig(**{**base.__dict__, "num_pages": 1024, "enable_prefix_cache": False}), [prompt])
    faults = FaultInjector()
    eng = Engine(base.with_hicache(enable=True, policy="always", host_ratio=1.0, storage_ratio=8.0), faults=faults)
    params = SamplingParams(max_tokens=8)

    async def go():
        await eng.start()
        first = await eng.generate_async([prompt], params)
        await eng.cache.drain()
        eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
        eng.cache.tree.evict(Tier.L2, eng.cache.l2.num_pages)
        m = eng.cache.tree.match(tokens, touch=False)
        assert m.lengths == [0, 0, len(tokens)]
        if flip:
            flip_l3_byte(eng.cache, m.pages[Tier.L3][1])
        faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=0.05)
        with capture_op_logs() as logs:
            again = await eng.generate_async([prompt], params)
            await eng.cache.drain()
        eng.check_integrity()  # (not assert_whole: the CUDA graphs' scratch page is private)
        await eng.shutdown()
        return first[0], again[0], logs

    first, again, logs = asyncio.run(go())
    assert first.output_ids == again.output_ids == ref[0]
    [path] = op_transitions(logs, "prefetch_l3").values()
    taken = ["L3", "S2H_PENDING", "S2H_LANDED", "H2D_VERIFYING"]
    assert path == taken + (["FAILED"] if flip else ["H2D_PENDING", "L1_L2_L3"])
    assert again.cached_tokens["l3"] == (0 if flip else len(tokens))
    assert eng.stats["restore_waits_timed_out"] == 0

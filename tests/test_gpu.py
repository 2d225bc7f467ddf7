"""GPU-only checks (skipped without CUDA): CUDA graphs and the Triton decode kernel give the same
greedy outputs as eager execution, and restores through the real DMA path equal recompute. The
transfer engine's own GPU checks: tests/test_gpu_transfers.py."""
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


def run(cfg, ps, max_tokens=8, one_by_one=False):
    """one_by_one: each prompt a generate() of its own, so it arrives once the earlier ones ended and
    their backups landed (a prefix then in L3 is prefetched at queue time)."""
    from scheduler.engine import Engine
    eng = Engine(cfg)
    batches = [[p] for p in ps] if one_by_one else [ps]
    out = [r.output_ids for b in batches for r in eng.generate(b, SamplingParams(max_tokens=max_tokens))]
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


@pytest.mark.parametrize("max_running,graph", [(50, 64), (100, 128)])
def test_a_decode_batch_between_graph_sizes_replays_the_next_size_up(max_running, graph):
    """Session 39. Regression: with --max-running-requests 50, decode graphs stopped at 48 and batches of
    49-50 ran eagerly (and every batch over 64 did). Now the next size up is captured; its padding rows
    change no output."""
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=4096, page_size=16,
                        cuda_graphs=True, max_running_requests=max_running)
    ps = prompts(n=max_running)
    eager, _ = run(EngineConfig(**{**base.__dict__, "cuda_graphs": False}), ps)
    graphs, eng = run(base, ps)
    assert eng.runner.graphs.shape_for([1] * max_running, [[0]] * max_running) == (graph, 1)
    assert graphs == eager


@pytest.mark.parametrize("tier,overlap,graphs,kernel_tokens,whole", [
    ("l2", True, True, 1024, False), ("l2", True, True, 0, False), ("l2", True, False, 1024, False),
    ("l2", False, True, 1024, False), ("l3", True, True, 1024, False), ("l2", True, True, 0, True)])
def test_restores_equal_recompute_on_gpu(tier, overlap, graphs, kernel_tokens, whole, monkeypatch):
    """kernel_tokens: restores up to this long by the copy kernel (1024; the default is 4096), 0: by 2-D DMAs
    (the tiny model's 2 KiB slabs would take the kernel anyway: allowed 2-D DMAs here). whole: every
    layer-ordered restore moves all but its last page whole first (its forward is far shorter than
    the tiny model's restores would need for the engine to choose that itself)."""
    import hicache.transfer_layered as layered

    if kernel_tokens == 0:
        monkeypatch.setattr("hicache.transfer.MIN_DMA_ROW_BYTES", 0)
    wholes = []
    if whole:
        real = layered.LayeredRestores._whole_first
        monkeypatch.setattr("hicache.manager.CacheManager.whole_first_pages", lambda self, n, tail_tokens=0: n - 1)
        monkeypatch.setattr(layered.LayeredRestores, "_whole_first",
                            lambda self, tr, h0, pages: (wholes.append(len(pages)), real(self, tr, h0, pages)))
    rng = random.Random(1)
    bases = [[rng.randrange(512) for _ in range(64)] for _ in range(4)]  # L1 holds about two
    ps = [bases[i % 4] + [rng.randrange(512) for _ in range(1 + i % 3)] for i in range(16)]
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=12, page_size=16,
                        max_running_requests=1, restore_overlap=overlap, cuda_graphs=graphs)
    ref, _ = run(EngineConfig(**{**base.__dict__, "num_pages": 1024, "enable_prefix_cache": False}), ps)
    cfg = base.with_hicache(enable=True, policy="always", host_ratio=4.0 if tier == "l2" else 1.0,
                            storage_ratio=0.0 if tier == "l2" else 8.0, kernel_restore_max_tokens=kernel_tokens)
    # L3: one request at a time, so a prefix in L3 is prefetched at queue time and its read taken on
    # to L1 under the tail forward. (All at once, the L3 restores ran whole: until session 29 they
    # overlapped only after an H2D that found no L1 room, later requests having taken its room.)
    out, eng = run(cfg, ps, one_by_one=tier == "l3")
    assert out == ref
    assert eng.metrics()["hit_tokens"][tier] > 0
    assert (eng.stats["restore_overlaps"] > 0) == overlap
    assert eng.stats["restore_waits_timed_out"] == 0  # every layer wait saw its copy land
    assert (eng.cache.overlap_forward_s or 0) > 0 if graphs else eng.cache.overlap_forward_s is None
    assert bool(wholes) == whole


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


def test_the_graphs_scratch_page_is_not_promised_to_requests():
    """A request needing every L1 page (the graphs hold one) used to be accepted and block the queue."""
    from scheduler.engine import Engine
    from scheduler.request import RequestError

    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=12, page_size=16,
                              cuda_graphs=True))
    assert eng.usable_l1_pages == 11
    with pytest.raises(RequestError, match="needs 12 pages"):
        eng.add_request(list(range(1, 173)), SamplingParams(max_tokens=20))
    [whole, small] = eng.generate([list(range(1, 173)), [1, 2, 3]], SamplingParams(max_tokens=4))
    assert whole.error is None and small.error is None
    eng.check_integrity()


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
    """Forwards of <= 64 rows (decode, tails, short prefills) with projections by kernels/skinny_gemm.py (the
    default) and by cuBLAS: same greedy outputs; and the kernel in bf16 at the 8B shapes, 1 to 64 rows, in the
    operand order and K split the layer runs each with (qkv and o_proj swapped)."""
    import torch.nn.functional as F

    from kernels import skinny_gemm
    base = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16)
    ps = prompts(seed=4)
    triton_out, eng = run(base, ps)
    assert eng.model.skinny
    cublas_out, eng = run(EngineConfig(**{**base.__dict__, "small_gemm": "cublas"}), ps)
    assert not eng.model.skinny
    assert triton_out == cublas_out
    for n, k, swiglu in [(6144, 4096, False), (2 * 12288, 4096, True), (4096, 12288, False), (4096, 4096, False)]:
        for m in (1, 16, 32, 64):  # (row tiles of 16, 32 and 64)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            want = F.linear(x.float(), w.float())
            if swiglu:
                gate, up = want.chunk(2, dim=-1)
                want = F.silu(gate) * up
            split = 1 if swiglu else skinny_gemm.split_k_for(n, k)  # as the layer runs them
            got = skinny_gemm.linear(x, w, swiglu=swiglu, split_k=split).float()
            got = got.sum(0) if split > 1 else got
            assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_fp32_lm_head_logits_are_the_float32_sums_and_serve_through_graphs():
    """On CUDA with bf16 weights the LM head's logits are its float32 sums (within float32 accumulation of a
    float64 reference), where the bf16 output is rounded to steps of 1/32 at magnitude 4; and greedy serving
    through the decode and tail graphs equals eager serving with them (the float32-output GEMM captures)."""
    from scheduler.engine import Engine
    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="bfloat16", num_pages=256, page_size=16))
    model = eng.model
    assert model.fp32_lm_head
    hidden = torch.randn(16, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    want = hidden.double() @ model.lm_head_weight.double().t()  # [16, V]
    got = model.logits_of(hidden)
    assert got.dtype == torch.float32
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err < 1e-5 * scale
    model.fp32_lm_head = False
    rounded = model.logits_of(hidden)
    model.fp32_lm_head = True
    assert (rounded.double() - want).abs().max().item() > 10 * err  # what the float32 output keeps
    ps = prompts(seed=7)
    base = EngineConfig(model="tiny", device="cuda", dtype="bfloat16", num_pages=512, page_size=16)
    graphs, eng = run(base, ps)
    assert eng.runner.graphs is not None and eng.model.fp32_lm_head
    eager, _ = run(EngineConfig(**{**base.__dict__, "cuda_graphs": False}), ps)
    assert graphs == eager


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


def test_spread_tail_attention_equals_the_reference():
    """A 16-row tail's paged attention at the 8B shape (bf16, 3,500 cached keys), launched with PDL
    and spread one split program an SM (kernels/pdl.py spread: its compiled kernel asks for more
    than half an SM's shared memory) from its second launch: the same output as the first launch,
    and the torch reference's within bf16."""
    from kernels import decode_attention, pdl
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs sm_90 and Triton >= 3.4")
    g = torch.Generator(device="cuda").manual_seed(2)
    page, hkv, hq, d, cached = 16, 8, 32, 128, 3500
    pages = (cached + 16 + page - 1) // page
    k_layer, v_layer = (torch.randn(pages + 3, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
                        for _ in range(2))
    table = torch.randperm(pages + 3, device="cuda", generator=g)[:pages][None]  # [1, pages]
    q = torch.randn(16, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    seq_lens = torch.arange(cached + 1, cached + 17, device="cuda")  # row r sees its own token
    run = lambda: decode_attention.decode_attention_triton(q, k_layer, v_layer, table, seq_lens, d ** -0.5,
                                                           rows_per_seq=16)  # noqa: E731
    first, spread = run(), run()
    assert any(k.metadata.shared >= pdl._spread_bytes(torch.cuda.current_device()) for k in pdl._spread)
    assert torch.equal(first, spread)
    ref = decode_attention.decode_attention_torch(q, k_layer, v_layer, table, seq_lens, d ** -0.5, rows_per_seq=16)
    torch.testing.assert_close(spread.float(), ref.float(), rtol=2e-2, atol=2e-2)


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


def test_a_seeded_sampled_request_runs_on_cuda_beside_a_greedy_one():
    """Regression (found on the CPU by reading, seen on the H200 by a probe): the request's generator
    is made for "cuda" and the logits live on "cuda:0"; sampling compared the devices, took its CPU
    path with the CUDA generator and raised inside the loop, failing every request of the engine.
    A seeded request samples, repeats itself, and the greedy one beside it is served."""
    from scheduler.engine import Engine
    from scheduler.sampling import sample

    gen = torch.Generator(device=torch.device("cuda")).manual_seed(0)
    ids = sample(torch.randn(2, 64, device="cuda"), [0.0, 1.0], [1.0, 1.0], [None, gen])
    assert ids.device.type == "cuda" and 0 <= int(ids[1]) < 64
    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=256, page_size=16))
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=42, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    out = eng.generate([[5, 6, 7, 8, 9], [10, 11, 12]], [seeded, greedy])
    assert [(r.finish_reason, r.error) for r in out] == [("length", None), ("length", None)]
    assert eng.generate([[5, 6, 7, 8, 9]], seeded)[0].output_ids == out[0].output_ids


def test_l1_sized_from_the_gpus_memory_serves_a_full_prefill_and_decode_batch_within_the_fraction():
    """max_total_tokens 0 on CUDA (the CLI's default): L1 takes what gpu_memory_fraction of the device
    leaves after what is in use and the activation reserve (scheduler/memory_plan.py); a batch of
    max_running_requests prompts of max_prefill_tokens each then prefills and decodes, and torch's peak
    reservation stays within the fraction (the reserve was enough)."""
    import gc

    from scheduler.engine import Engine
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    fraction = 0.6  # (leaves the rest to whatever else this test process holds)
    eng = Engine(EngineConfig(model="qwen3-0.6b", device="cuda", max_total_tokens=0, gpu_memory_fraction=fraction,
                              max_prefill_tokens=2048, max_running_requests=32))
    l1_bytes = eng.cache.l1.num_pages * eng.cache.geometry.bytes_per_page
    assert l1_bytes > 0.3 * total, (l1_bytes / 2**30, total / 2**30)  # sized from the device, not 8,192 tokens
    torch.cuda.reset_peak_memory_stats()
    rng = random.Random(5)
    ps = [[rng.randrange(1, 150_000) for _ in range(2048)] for _ in range(32)]
    results = eng.generate(ps, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, top_p=0.9))
    assert all(len(r.output_ids) == 4 and r.error is None for r in results)
    # (what was in use before counted against the fraction too, so torch's peak alone must fit it)
    assert torch.cuda.max_memory_reserved() <= fraction * total, \
        (torch.cuda.max_memory_reserved() / 2**30, fraction * total / 2**30)
    eng.check_integrity()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_logprobs_on_cuda_with_graphs_and_a_batch_beside(dtype):
    """CUDA, the fused forward and CUDA graphs on: a prompt-logprobs request's prefill runs eagerly (every
    row's final norm, `add_rms_norm_triton(rows=None)`), chunked, beside plain requests that may replay
    graphs; its values match the dense forward's, its tokens and the others' equal those of the same
    requests without it, and k = 0 (the chosen token's alone) comes back too."""
    from scheduler.engine import Engine
    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype=dtype, page_size=16, num_pages=256,
                              max_prefill_tokens=64))
    prompt = [(7 * i + 3) % 500 for i in range(150)]  # 3 chunks of 64
    others = [[(11 * i + j) % 500 for i in range(20 + j)] for j in range(3)]
    params = [SamplingParams(max_tokens=4, prompt_logprobs=3)] + [SamplingParams(max_tokens=4)] * 3
    got = eng.generate([prompt] + others, params)
    plain = eng.generate([prompt] + others, SamplingParams(max_tokens=4))
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]
    with torch.inference_mode():
        ref = torch.log_softmax(eng.model.forward_dense(torch.tensor(prompt, device="cuda")).float(), dim=-1)
    tol = 1e-3 if dtype == "float32" else 0.15  # (bf16: the paged forward and the dense one round apart)
    lps = got[0].prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for i in range(1, len(prompt)):
        assert abs(lps[i].logprob - float(ref[i - 1][prompt[i]])) < tol, i
        assert len(lps[i].top) == 3
        # its rank, counted on the device: the tokens at least as likely as it (vLLM's), from the same logprobs
        # the top 3 came from, so within them it is its place (ties count as ahead), past them beyond 3
        ahead = sum(v >= lps[i].logprob for _, v in lps[i].top)
        assert lps[i].rank >= 1 and (lps[i].rank == ahead if ahead < 3 else lps[i].rank >= 3), i
    [zero] = eng.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert zero.output_ids == [] and all(lp.top == [] for lp in zero.prompt_logprobs[1:])
    eng.check_integrity()


def test_structured_outputs_on_cuda_with_graphs_beside_unguided_rows():
    """Guided rows' masks applied on the device to the decode graphs' logits (scheduler/guided.py): every
    guided answer is what its grammar allows, sampled and greedy; the unguided rows beside them get the
    answers they get alone (their batch unchained)."""
    import json
    import re

    pytest.importorskip("llguidance")
    from scheduler.engine import Engine
    from scheduler.guided import GuidedSpec
    from scheduler.tokenizer import ByteTokenizer

    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16))
    assert eng.runner.graphs is not None
    tok = ByteTokenizer(eng.vocab_size)
    ps = [tok.encode(f"request {i}: ") for i in range(8)]
    alone = [r.output_ids for r in eng.generate(ps[::2], SamplingParams(max_tokens=24))]
    regex = GuidedSpec("regex", "[a-z]{3}-[0-9]{2,4}")
    schema = GuidedSpec("json_schema", json.dumps({"type": "object", "properties": {"k": {"enum": ["a", "b"]}},
                                                   "required": ["k"], "additionalProperties": False}))
    params = [SamplingParams(max_tokens=24) if i % 2 == 0 else
              SamplingParams(max_tokens=24, guided=regex if i % 4 == 1 else schema, temperature=1.0 * (i > 4), seed=i)
              for i in range(8)]
    out = eng.generate(ps, params)
    assert [r.output_ids for r in out[::2]] == alone
    for i, r in enumerate(out):
        if i % 2:
            text = tok.decode(r.output_ids)
            assert r.finish_reason == "stop", (i, text)
            assert re.fullmatch("[a-z]{3}-[0-9]{2,4}", text) if i % 4 == 1 else json.loads(text) in ({"k": "a"},
                                                                                                     {"k": "b"})
    eng.check_integrity()


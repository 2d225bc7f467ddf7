"""Guards for kernel and graph-choice rules a mutation check (session 56) found no test breaking: the paged
attention's seq_lens check, split-K partials' rounding and dtype in the fused norm, SiLU's writes staying in
its output, the skinny projections' contiguous weight and split-K rule, the sampling kernel's contiguous rows
and a top_k of exactly K_LIMIT, PDL's switch and spread size, the direct launcher's int64 variants, and which
CUDA graph (decode, tail, fresh prefill) a batch replays. All on the CPU (Triton under TRITON_INTERPRET=1;
DecodeGraphs' choices read only its shapes, so they run on a stand-in without capturing)."""
import contextlib
import math
import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import fused_ops, pdl, rejection_sampling, skinny_gemm  # noqa: E402
from kernels.decode_attention import decode_attention_triton  # noqa: E402
from kernels.direct_launch import DirectLaunch  # noqa: E402
from kernels.rejection_sampling import pack_params, sample_rows, set_kth_logits  # noqa: E402
from scheduler.cuda_graphs import PREFILL_BUCKETS, TAIL_ROWS, DecodeGraphs, graph_shapes  # noqa: E402
from test_direct_launch import FakeJit  # noqa: E402
from test_rejection_sampling import LOGITS, draw  # noqa: E402


# ---- paged decode attention ------------------------------------------------------------------------

def test_decode_attention_refuses_seq_lens_that_do_not_match_its_rows():
    """A caller that passes one key count too many (or too few) for its query rows gets an error naming
    seq_lens, not an attention computed over lengths read past the rows it meant."""
    q = torch.zeros(2, 4, 16)
    kv = torch.zeros(4, 4, 2, 16)
    tables = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="seq_lens 3"):
        decode_attention_triton(q, kv, kv, tables, torch.ones(3, dtype=torch.int64), 0.25)


# ---- fused norm and SiLU ---------------------------------------------------------------------------

def test_split_k_partials_take_the_residuals_dtype_over_the_norm_weights():
    """A split-K projection's float32 partials beside a bf16 residual stream give a bf16 stream and norm
    output, even when the norm's weight is float32 (the residual's dtype wins, the weight's only without one)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 64, generator=g)
    res = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g)
    y, s = fused_ops.add_rms_norm_triton(x, res, w, 1e-6)
    assert y.dtype == s.dtype == torch.bfloat16
    y_ref, s_ref = fused_ops.add_rms_norm_torch(x.sum(0).to(torch.bfloat16).float(), res.float(), w, 1e-6)
    torch.testing.assert_close(s.float(), s_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)


def test_split_k_partials_round_to_the_model_dtype_before_the_residual_add():
    """Split-K partials are rounded to bf16 (as the whole projection's output would be) before the residual
    is added, so splitting K does not change the residual stream: partials adding up to 1 + 2**-10 (1.0 in
    bf16) plus a residual of -1 give exactly 0, as the unsplit projection does."""
    x = torch.full((2, 2, 64), 0.5)
    x[0] += 2.0 ** -10
    res = torch.full((2, 64), -1.0, dtype=torch.bfloat16)
    res[1] = 0.25
    w = torch.ones(64, dtype=torch.bfloat16)
    _, s = fused_ops.add_rms_norm_triton(x, res, w, 1e-6)
    assert s[0].eq(0).all() and s[1].eq(1.25).all(), s
    _, whole = fused_ops.add_rms_norm_triton(x.sum(0).to(torch.bfloat16), res, w, 1e-6)
    assert torch.equal(s, whole)


def test_silu_mul_writes_its_output_and_nothing_past_it(monkeypatch):
    """silu(gate) * up writes exactly its [T, I] output: nothing past a row's end (the next row's first
    element, or memory after the last row), for an intermediate size below and at a power of two."""
    real_empty = torch.empty
    buffers = []

    def padded_empty(shape, **kw):  # the output, followed by sentinels the kernel must leave alone
        n = int(torch.Size(shape).numel())
        buf = torch.full((n + 64,), 123.0, dtype=kw.get("dtype", torch.float32), device=kw.get("device"))
        buffers.append(buf)
        return buf[:n].view(shape)

    g = torch.Generator().manual_seed(4)
    for inter in (40, 64):
        x = torch.randn(3, 2 * inter, generator=g)
        monkeypatch.setattr(torch, "empty", padded_empty)
        out = fused_ops.silu_mul_triton(x)
        monkeypatch.setattr(torch, "empty", real_empty)
        torch.testing.assert_close(out, fused_ops.silu_mul_torch(x), rtol=1e-5, atol=1e-5)
        assert (buffers[-1][out.numel():] == 123.0).all(), inter


# ---- skinny projections ----------------------------------------------------------------------------

def test_skinny_projection_refuses_a_non_contiguous_weight():
    """A weight that is a transposed view (its rows strided) is refused, not read as if it were row-major."""
    x = torch.randn(4, 64)
    w = torch.randn(64, 32).t()  # [32, 64], column-major
    with pytest.raises(ValueError, match="contiguous"):
        skinny_gemm.linear(x, w)


def test_split_k_goes_to_projections_of_at_most_4096_columns_over_a_long_k():
    """Two K splits exactly where a column block per program leaves too few programs: N <= 4096 with
    K >= 4096 (the 8B o_proj and down); wider outputs (qkv) and shorter K stay whole."""
    assert skinny_gemm.split_k_for(4096, 4096) == 2  # the 8B o_proj
    assert skinny_gemm.split_k_for(4096, 12288) == 2  # the 8B down
    assert skinny_gemm.split_k_for(2560, 9728) == 2
    assert skinny_gemm.split_k_for(4097, 12288) == 1
    assert skinny_gemm.split_k_for(4096, 4095) == 1
    assert skinny_gemm.split_k_for(6144, 4096) == 1  # qkv


# ---- sampling kernel -------------------------------------------------------------------------------

def test_sampling_kernel_refuses_logits_whose_rows_are_not_contiguous():
    """The kernel reads each row as contiguous tokens: logits whose rows are strided are refused."""
    logits = torch.randn(8, 3).t()  # [3, 8], each row strided
    params = pack_params([0, 1, 2], [1.0] * 3, [0.9] * 3, [-math.inf] * 3, [0] * 3, [1, 2, 3])
    with pytest.raises(ValueError, match="contiguous"):
        sample_rows(logits, params)


def test_a_top_k_of_exactly_k_limit_gets_its_kth_logit_and_the_nucleus_of_its_top_k_set(monkeypatch):
    """A row with top_k equal to K_LIMIT (32 by default; 2 here) and top_p gets its k-th logit from the chunk
    kernels like any smaller k (a larger k from torch.topk), so its top-p is taken over the top-k set: with
    k 2 the two likeliest weigh 0.645 / 0.355, and top_p 0.6 keeps the likeliest alone."""
    monkeypatch.setattr(rejection_sampling, "K_LIMIT", 2)
    logits = LOGITS.expand(2, -1).contiguous()
    params = pack_params([0, 1], [1.0] * 2, [0.6] * 2, [-math.inf] * 2, [2, 3], [7, 8])
    set_kth_logits(logits, params, [0, 1], [2, 3])
    assert params[7].view(torch.float32).tolist() == [LOGITS[1].item(), LOGITS[2].item()]
    n = 12
    assert draw(LOGITS.expand(n, -1), list(range(n)), 1.0, 0.6, 0.0, 2, list(range(n))).eq(0).all()


# ---- PDL and the direct launcher -------------------------------------------------------------------

def test_pdl_switched_off_stays_off_on_a_gpu_that_could_run_it(monkeypatch):
    """set_enabled(False) (HICACHE_PDL=0, or an A/B run without PDL) turns PDL off for launches on a GPU that
    supports it, and set_enabled(True) turns it back on."""
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    gpu = torch.device("cuda", 0)
    previous = pdl.set_enabled(True)
    try:
        assert pdl.enabled(gpu) and pdl.launch_kwargs(gpu) == {"PDL": True, "launch_pdl": True}
        pdl.set_enabled(False)
        assert not pdl.enabled(gpu) and pdl.launch_kwargs(gpu) == {"PDL": False}
    finally:
        pdl.set_enabled(previous)


def test_spread_asks_for_just_over_half_an_sm_and_may_take_a_blocks_whole_opt_in(monkeypatch):
    """The spread size is the first 16 KiB step above half an SM's shared memory (128 KiB on the H200's
    228 KiB; still 128 where 112 is exactly half, so two programs never fit); a GPU whose block may opt in
    to exactly that much still spreads, one whose block may not does not."""
    def spread_bytes(per_sm_kib, optin_kib):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(
            shared_memory_per_multiprocessor=per_sm_kib << 10, shared_memory_per_block_optin=optin_kib << 10))
        return pdl._spread_bytes.__wrapped__(0)

    assert spread_bytes(228, 227) == 128 << 10
    assert spread_bytes(224, 227) == 128 << 10
    assert spread_bytes(256, 144) == 144 << 10  # exactly the opt-in limit
    assert spread_bytes(256, 143) is None


def test_an_int_past_int32_is_another_variant_for_the_direct_launcher(monkeypatch):
    """The JIT types an int of 2**31 or more as int64, so the direct launcher must not reuse a kernel
    compiled for an int32 argument for it (an offset past 2 GiB would wrap); int32's least value still is
    the int32 variant."""
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    fn, stream = FakeJit(), SimpleNamespace(cuda_stream=1)
    launch = DirectLaunch(fn)
    x = torch.zeros(16, dtype=torch.int32)
    launch((1,), stream, x, 32, 2**31 - 1, BLOCK=16)
    launch((1,), stream, x, 32, 5, BLOCK=16)
    assert [c[0] for c in fn.calls] == ["jit", "direct"]
    launch((1,), stream, x, 32, 2**31, BLOCK=16)
    assert fn.calls[-1][0] == "jit"
    launch((1,), stream, x, 2**31 - 16, 5, BLOCK=16)
    launch((1,), stream, x, 2**31, 5, BLOCK=16)  # both multiples of 16: only the width tells them apart
    assert fn.calls[-1][0] == "jit"
    launch((1,), stream, x, 32, -2**31, BLOCK=16)
    assert fn.calls[-1][0] == "direct"


# ---- which CUDA graph a batch replays --------------------------------------------------------------

def _graphs(max_batch=8, max_pages=10):
    """What DecodeGraphs' choices read, as it would hold them after capturing for `max_batch`."""
    shapes = graph_shapes(max_batch)
    return SimpleNamespace(shapes=shapes, graphs={s: object() for s in shapes}, max_pages=max_pages,
                           prefill_buckets=list(PREFILL_BUCKETS))


def test_a_prefill_over_a_cached_prefix_never_replays_the_fresh_prefill_graph():
    """The prefill graphs compute a sequence from position 0 with no cached keys: a prefill over a cached
    prefix (or of several sequences) must not replay one, or its logits ignore the prefix."""
    g = _graphs()
    assert DecodeGraphs.prefill_bucket(g, [0], [100]) == 128
    assert DecodeGraphs.prefill_bucket(g, [32], [100]) is None
    assert DecodeGraphs.prefill_bucket(g, [0, 0], [40, 40]) is None


def test_a_fresh_prefill_pads_to_the_smallest_bucket_that_holds_it():
    """A fresh prefill of n tokens replays the smallest captured length >= n (a prompt of exactly a bucket's
    length takes that bucket, the longest one included); past the longest it runs eagerly."""
    g = _graphs()
    got = [DecodeGraphs.prefill_bucket(g, [0], [n]) for n in (17, 63, 64, 65, 128, 500, 512, 513)]
    assert got == [64, 64, 64, 128, 128, 512, 512, None]


def test_a_batch_takes_the_smallest_graph_that_holds_it_up_to_the_edges():
    """Decode and tail batches replay a graph up to the edges: a page table of exactly max_pages, a tail of
    exactly TAIL_ROWS new tokens, a batch of exactly a captured size (the max batch included), each taking
    the smallest graph that holds it; one page or one token more runs eagerly."""
    g = _graphs(max_batch=8, max_pages=10)
    full, short = [list(range(10))], [list(range(3))]
    assert DecodeGraphs.shape_for(g, [1], full) == (1, 1)
    assert DecodeGraphs.shape_for(g, [1], [list(range(11))]) is None
    assert DecodeGraphs.shape_for(g, [TAIL_ROWS], short) == (1, TAIL_ROWS)
    assert DecodeGraphs.shape_for(g, [TAIL_ROWS + 1], short) is None
    assert DecodeGraphs.shape_for(g, [1] * 4, short * 4) == (4, 1)
    assert DecodeGraphs.shape_for(g, [1] * 5, short * 5) == (8, 1)
    assert DecodeGraphs.shape_for(g, [1] * 8, short * 8) == (8, 1)
    assert DecodeGraphs.shape_for(g, [3] * 8, short * 8) == (8, TAIL_ROWS)

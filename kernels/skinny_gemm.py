"""Small-M projections (decode of up to 64 sequences, a restore's short tail, verify steps), and gate_up with
SwiGLU folded in.

With a handful of rows a projection is a weight read: every output column streams its weight row
once. cuBLAS gets close, but picks split-K plus a reduce kernel for some of these shapes, and SwiGLU
after gate_up costs a kernel of its own. This kernel streams each weight block once per program (one
block of output columns, the whole K or a part of it), with tensor-core dots on a row tile of 16, 32 or 64
rows (the call's rows rounded up):

  linear(x, W)                 y = x @ W^T                                x [M, K], W [N, K] -> y [M, N]
  linear(x, W, swiglu=True)    W = [gate; up] [2I, K]: y = silu(x @ gate^T) * (x @ up^T)   -> y [M, I]
  linear(x, W, split_k=P)      float32 partials over P parts of K, for a consumer that adds them
                               (the residual add + RMSNorm after o_proj and down)      -> y [P, M, N]

Two operand orders: x @ W^T (the [BM, BK] input tile times the weight tile) or, `swapped`, (W @
x^T)^T, which puts the weight tile first, as the tensor cores' M side (64 columns), with the rows
second. One projection on its own is 1-2 us faster swapped at every 8B shape, but in a chain of
the layer's projections under PDL only qkv and o_proj keep the gain (a 36-layer chain 3.62 -> 3.51
ms); a swapped gate_up or down made it slower (3.86 / 3.69 ms), so they stay as they were. The
tail forward after a restore: 8B 4.72 -> 4.68 ms, 4B 3.24 -> 3.19 ms (docs/benchmarks.md, session 19).

M is at most MAX_ROWS (64). Up to 16 rows this was the only row tile (session 6). Tiles of 32 and 64 rows
(session 50, H200, 8B shape, a layer's four projections): 106.9 against cuBLAS's 115.6 us at 32 rows, 115.1
against 117.8 at 64 (gate_up alone is slower there, 59.6 against 57.0); batch-32 decode 5,890 against 5,590
tokens/s, batch 64 9,730 against 9,610. Folding the residual add + RMSNorm into the same loop was measured and
dropped: the element-wise prologue on every K block kept the loads from pipelining (qkv 51 us
against 19 us for the norm kernel + cuBLAS, docs/benchmarks.md). Run on the CPU under
TRITON_INTERPRET=1 in tests.
"""
from __future__ import annotations

import functools

import torch

from kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    triton = None

BLOCK_M = 16  # the smallest row tile: decode of up to 16 sequences, a 16-row tail
MAX_ROWS = 64  # rows per call at most (row tiles of 16, 32 or 64: `_row_tile`)
SHARED_BYTES = 200 << 10  # pipeline stages fit in this much shared memory (the H200 has 227 KiB a block)


@functools.lru_cache(maxsize=None)
def _shared_budget(device: torch.device) -> int:
    """SHARED_BYTES, or less on a GPU with less shared memory a block (minus room for the epilogue)."""
    if device.type != "cuda":
        return SHARED_BYTES
    return min(SHARED_BYTES, torch.cuda.get_device_properties(device).shared_memory_per_block_optin - (16 << 10))


def split_k_for(n_out: int, k: int) -> int:
    """K splits for a projection whose consumer adds partials (o_proj and down feed the residual add +
    RMSNorm, kernels/fused_ops.py): 2 where a column block per program leaves too few programs to
    keep the weight stream going (N <= 4096 with a long K). On the H200 at the 8B shape, 16 rows:
    o_proj 11.8 -> 10.7 us, down 28.2 -> 26.9 us (scripts/bench_kernels.py --skinny-split); qkv
    gains 0.2 us and its consumer reads bf16, so it stays whole. Two partials add up the same in
    either order, so the result does not depend on which program finishes first."""
    return 2 if n_out <= 4096 and k >= 4096 else 1


def _row_tile(m: int) -> int:
    """The row tile of an m-row call: 16, 32 or 64 (the weight tile is read once for all of its rows)."""
    return max(BLOCK_M, triton.next_power_of_2(m))


def _config(n_out: int, k: int, swiglu: bool, elem_bytes: int, budget: int = SHARED_BYTES,
            split_k: int = 1, block_m: int = BLOCK_M) -> dict:
    """Block sizes tuned on the H200 at the 8B shapes in bf16 (scripts/bench_kernels.py --skinny and
    --skinny-split; the operand order by chains of the layer's projections, session 19;
    docs/benchmarks.md), then cut to fit: K blocks no longer than a split's share of
    K, stages (each a [BN or 2 BN, BK] weight tile and a [16, BK] input tile) within `budget` bytes
    (float32 needs twice the bytes)."""
    swapped = False
    if swiglu:  # gate_up: two weight tiles per stage
        bn, bk, stages = 32, 128, 4
    elif n_out >= 6144:  # qkv
        bn, bk, stages, swapped = 64, 128, 5, True
    elif split_k > 1:  # o_proj (swapped), down in two K halves
        bn, bk, stages, swapped = (64, 256, 4, False) if k > 4096 else (64, 128, 5, True)
    else:  # o_proj, down
        bn, bk, stages = 32, 256, 5
    bk = min(bk, max(16, triton.next_power_of_2(-(-k // split_k))))  # no longer than a split's share of K

    def stage_bytes(block_k: int) -> int:
        return (bn * (2 if swiglu else 1) + block_m) * block_k * elem_bytes

    while bk > 16 and stage_bytes(bk) * 2 > budget:
        bk //= 2
    stages = max(2, min(stages, budget // stage_bytes(bk)))
    return dict(BLOCK_N=bn, BLOCK_K=bk, SWAPPED=swapped, num_warps=4, num_stages=stages)


if triton is not None:
    @triton.jit
    def _dot(x, w, SWAPPED: tl.constexpr, IEEE: tl.constexpr):
        """x [BM, BK], w [BN, BK] -> x @ w^T, or with SWAPPED its transpose w @ x^T [BN, BM]."""
        if SWAPPED:
            a, b = w, tl.trans(x)
        else:
            a, b = x, tl.trans(w)
        if IEEE:  # float32 weights: exact fp32 products (no TF32)
            out = tl.dot(a, b, input_precision="ieee")
        else:
            out = tl.dot(a, b)
        return out

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, SWIGLU: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, SWAPPED: tl.constexpr, PDL: tl.constexpr):
        """Program (column block, K split): the split's share of K in BLOCK_K steps; with SPLIT_K > 1
        the float32 partial sum goes to y[split] ([SPLIT_K, M, N]) for the consumer to add up.
        SWAPPED: the accumulator is [BLOCK_N, BLOCK_M] (see the module doc), transposed at the store.
        PDL (kernels/pdl.py): wait for the kernel before (which writes x) first."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = split * k_per
        k_hi = tl.minimum(K, k_lo + k_per)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if SWAPPED:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros_like(acc)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wm = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=wm, other=0.0)  # [BN, BK]
            acc += _dot(x, w, SWAPPED, IEEE)
            if SWIGLU:  # the up rows sit N rows below the gate rows
                wu = tl.load(w_ptr + (cols[:, None] + N) * K + ks[None, :], mask=wm, other=0.0)
                acc_up += _dot(x, wu, SWAPPED, IEEE)
        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if SWAPPED:
            acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        tl.store(y_ptr + split * M * N + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False, split_k: int = 1,
           **config) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] (1 <= M <= MAX_ROWS). swiglu: weight is [gate; up] [2I, K] and
    the result silu(x @ gate^T) * (x @ up^T) [M, I]. split_k > 1 (not with swiglu): K is cut in that
    many parts, each a program per column block, and the result is their float32 partial sums
    [split_k, M, N], added up by the consumer. config overrides the block sizes (benchmarks)."""
    m, k = x.shape
    if m > MAX_ROWS or m < 1:
        raise ValueError(f"skinny projections take 1..{MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"x [{m}, {k}] and weight {list(weight.shape)} must be contiguous with equal K")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"a [gate; up] weight has an even number of rows, got {weight.shape[0]}")
    if split_k < 1 or (swiglu and split_k > 1):
        raise ValueError(f"split_k must be >= 1, and 1 with swiglu (SiLU needs the whole sum), got {split_k}")
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    block_m = _row_tile(m)
    cfg = {**_config(n, k, swiglu, x.element_size(), _shared_budget(x.device), split_k, block_m), **config}
    if split_k == 1:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        y = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _skinny_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split_k)](x, weight, y, m, n, k, SWIGLU=swiglu,
                                                              IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
                                                              SPLIT_K=split_k, **pdl.launch_kwargs(x.device),
                                                              **cfg)
    return y

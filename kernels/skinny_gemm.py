"""Small-M projections (decode, a restore's short tail) with the layer's norm and SwiGLU folded in.

With a handful of rows a projection is a weight read: every output column streams its weight row
once. cuBLAS reaches that for the big ones, but with split-K and a reduce kernel for some shapes,
and the element-wise work between them (residual add + RMSNorm before qkv and gate_up, SiLU x up
after gate_up) costs a kernel each. These kernels stream the weight once per program block of
columns and do that work on the way:

  linear(x, W)                         y = x @ W^T                               x [M, K], W [N, K] -> y [M, N]
  norm_linear(h, residual, g, W)       s = h + residual; y = rmsnorm(s) * g @ W^T  -> (y [M, N], s [M, K])
  norm_linear(..., swiglu=True)        W = [gate; up] [2I, K]: y = silu(gate) * up  -> (y [M, I], s)

RMSNorm folds in exactly: rmsnorm(s) * g @ W^T = ((s * g) @ W^T) * rsqrt(mean(s^2) + eps) per row, so
each program reads its rows of s once, accumulating the sum of squares beside the dot product, and
scales its accumulator at the end (the rounding differs from norm-then-GEMM in the last bits). The
program of the first column block also writes s, the residual stream. M is at most BLOCK_M (16): a
tensor-core tile of rows. Run on the CPU under TRITON_INTERPRET=1 in tests.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    triton = None

BLOCK_M = 16  # rows per call at most: the small forwards (decode up to 16 sequences, a 16-row tail)


def _config(n_out: int, k: int, swiglu: bool) -> dict:
    """Block sizes by shape (tuned on the H200, scripts/bench_kernels.py --skinny)."""
    return dict(BLOCK_N=32 if not swiglu else 16, BLOCK_K=256, num_warps=4, num_stages=4)


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, res_ptr, g_ptr, w_ptr, y_ptr, sum_ptr, M, N, K, eps,
                       NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)  # squares, reduced once after the loop
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xm = row_ok[:, None] & k_ok[None, :]
            x_off = rows[:, None] * K + ks[None, :]
            x = tl.load(x_ptr + x_off, mask=xm, other=0.0)  # [BM, BK]
            if NORM:
                if HAS_RES:  # the residual stream is kept in the model's dtype
                    x = (x.to(tl.float32) + tl.load(res_ptr + x_off, mask=xm, other=0.0).to(tl.float32)).to(x.dtype)
                    if pid == 0:
                        tl.store(sum_ptr + x_off, x, mask=xm)
                xf = x.to(tl.float32)
                sq += xf * xf
                g = tl.load(g_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                x = (xf * g[None, :]).to(w_ptr.dtype.element_ty)
            wm = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=wm, other=0.0)  # [BN, BK]
            if IEEE:  # float32 weights: exact fp32 products (no TF32)
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
            if SWIGLU:  # the up rows sit N rows below the gate rows
                wu = tl.load(w_ptr + (cols[:, None] + N) * K + ks[None, :], mask=wm, other=0.0)
                if IEEE:
                    acc_up += tl.dot(x, tl.trans(wu), input_precision="ieee")
                else:
                    acc_up += tl.dot(x, tl.trans(wu))
        if NORM:
            inv = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)
            acc = acc * inv[:, None]
            acc_up = acc_up * inv[:, None]
        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    m, k = x.shape
    if m > BLOCK_M or m < 1:
        raise ValueError(f"skinny projections take 1..{BLOCK_M} rows, got {m}")
    if weight.shape[1] != k or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"x [{m}, {k}] and weight {list(weight.shape)} must be contiguous with equal K")
    return m, k


def linear(x: torch.Tensor, weight: torch.Tensor, **config) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] (M <= 16)."""
    m, k = _check(x, weight)
    n = weight.shape[0]
    cfg = {**_config(n, k, False), **config}
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](x, x, x, weight, y, y, m, n, k, 0.0, NORM=False,
                                                      HAS_RES=False, SWIGLU=False, IEEE=x.dtype == torch.float32,
                                                      BLOCK_M=BLOCK_M, **cfg)
    return y


def norm_linear(h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor,
                eps: float, swiglu: bool = False, **config) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(h + residual) * norm_weight) @ weight^T, and h + residual (residual None: h alone).
    swiglu: weight is [gate; up] [2I, K] and the output silu(gate) * up [M, I]."""
    m, k = _check(h, weight)
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    cfg = {**_config(n, k, swiglu), **config}
    y = torch.empty((m, n), dtype=h.dtype, device=h.device)
    s = torch.empty_like(h) if residual is not None else h
    _skinny_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        h, residual if residual is not None else h, norm_weight, weight, y, s, m, n, k, eps, NORM=True,
        HAS_RES=residual is not None, SWIGLU=swiglu, IEEE=h.dtype == torch.float32, BLOCK_M=BLOCK_M, **cfg)
    return y, s

"""Fused element-wise kernels of the Qwen3 layer (Triton), each with its torch reference.

A batch-1 forward of an 8B model is four weight-bound GEMMs per layer plus, in plain torch, some
twenty small kernels (norms, RoPE's slices and cats, K/V writes, SiLU, residual adds). Each small
kernel costs a few microseconds even inside a CUDA graph, which adds up to the weight reads' own time
over 36 layers. These three kernels replace them:

  add_rms_norm      residual += x; y = rmsnorm(residual) * w       x, residual: [T, H] -> y [T, H]
                    (x may be a split-K projection's float32 partials [P, T, H]; given row
                    numbers [B], only those rows -> [B, H])
  qk_norm_rope_kv   q/k rmsnorm, RoPE at each token's position, K and V stored into the paged
                    L1 pool at their slots                          qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D]
  silu_mul          silu(gate) * up                                 gate_up [T, 2 I] -> [T, I]

Arithmetic is float32 inside a kernel and rounds once to the tensor's dtype on the way out (the torch
references round after every op in bf16, so bf16 results differ in the last bit; float32 agrees to
~1e-6). Run on the CPU under TRITON_INTERPRET=1 in tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    triton = None


# ---- torch references ---------------------------------------------------------------------------

def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rmsnorm(x + residual) * weight, x + residual); residual None means x alone."""
    s = x if residual is None else x + residual
    return F.rms_norm(s, (s.shape[-1],), weight, eps), s


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qk_norm_rope_kv_torch(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                          cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor,
                          num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) D]; cos/sin: [N, D] tables; k_cache/v_cache: [P, S, Hkv, D] (one layer of the
    pool); out_slots: [T] (page * S + offset) -> q [T, Hq, D]. K/V land in the caches."""
    tokens = qkv.shape[0]
    d = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = F.rms_norm(q.view(tokens, num_heads, d), (d,), q_weight, eps)
    k = F.rms_norm(k.view(tokens, num_kv_heads, d), (d,), k_weight, eps)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, D]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    flat = (-1, num_kv_heads, d)
    k_cache.view(flat).index_copy_(0, out_slots, k)
    v_cache.view(flat).index_copy_(0, out_slots, v.reshape(tokens, num_kv_heads, d))
    return q


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- Triton ---------------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, rows_ptr, tokens, hidden, eps,
                             HAS_RES: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,
                             GATHER: tl.constexpr, PDL: tl.constexpr):
        """Program i: output row i of input row i, or of input row rows[i] with GATHER."""
        out_row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        if PDL:  # kernels/pdl.py: x is the kernel before's output (layer 0's gather: no kernel before it)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = out_row
        if GATHER:
            row = tl.load(rows_ptr + out_row).to(tl.int64)
        x = tl.load(x_ptr + row * hidden + cols, mask=ok, other=0.0)
        if PARTS > 1:  # a split-K projection's float32 partials [PARTS, T, H], added in order, rounded
            for p in tl.static_range(1, PARTS):  # as that projection's own output would be
                x += tl.load(x_ptr + (p * tokens + row) * hidden + cols, mask=ok, other=0.0)
            x = x.to(sum_ptr.dtype.element_ty)
        if HAS_RES:
            s = (x.to(tl.float32) + tl.load(res_ptr + row * hidden + cols, mask=ok, other=0.0).to(tl.float32))
            s = s.to(x.dtype)  # the residual stream is kept in the model's dtype
        else:
            s = x
        if HAS_RES or PARTS > 1 or GATHER:
            tl.store(sum_ptr + out_row * hidden + cols, s, mask=ok)
        s32 = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(s32 * s32, axis=0) / hidden + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + out_row * hidden + cols, (s32 * inv * w).to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _norm_rope_heads(src_ptr, w_ptr, cos_ptr, sin_ptr, pos, eps, num_heads,
                         HEADS: tl.constexpr, HALF: tl.constexpr):
        """Loads `num_heads` heads of D = 2 HALF at src_ptr, rmsnorm * w, RoPE -> two [HEADS, HALF] halves."""
        heads = tl.arange(0, HEADS)
        dims = tl.arange(0, HALF)
        ok = (heads < num_heads)[:, None]
        off = heads[:, None] * (2 * HALF) + dims[None, :]
        x1 = tl.load(src_ptr + off, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src_ptr + off + HALF, mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)  # [HEADS]
        w1 = tl.load(w_ptr + dims).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + dims).to(tl.float32)
        x1 = x1 * inv[:, None] * w1[None, :]
        x2 = x2 * inv[:, None] * w2[None, :]
        c1 = tl.load(cos_ptr + pos * (2 * HALF) + dims).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + pos * (2 * HALF) + HALF + dims).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + pos * (2 * HALF) + dims).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + pos * (2 * HALF) + HALF + dims).to(tl.float32)[None, :]
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, off, ok

    @triton.jit
    def _qk_norm_rope_kv_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                                q_out_ptr, k_cache_ptr, v_cache_ptr, eps, num_heads, num_kv_heads,
                                HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        d = 2 * HALF
        row = qkv_ptr + t * (num_heads + 2 * num_kv_heads) * d
        pos = tl.load(pos_ptr + t).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        q1, q2, off, ok = _norm_rope_heads(row, qw_ptr, cos_ptr, sin_ptr, pos, eps, num_heads, HQ, HALF)
        q_dst = q_out_ptr + t * num_heads * d
        tl.store(q_dst + off, q1.to(q_out_ptr.dtype.element_ty), mask=ok)
        tl.store(q_dst + off + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=ok)
        k1, k2, off, ok = _norm_rope_heads(row + num_heads * d, kw_ptr, cos_ptr, sin_ptr, pos, eps,
                                           num_kv_heads, HKV, HALF)
        k_dst = k_cache_ptr + slot * num_kv_heads * d
        tl.store(k_dst + off, k1.to(k_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(k_dst + off + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=ok)
        v_src = row + (num_heads + num_kv_heads) * d
        v_dst = v_cache_ptr + slot * num_kv_heads * d
        tl.store(v_dst + off, tl.load(v_src + off, mask=ok, other=0.0), mask=ok)
        tl.store(v_dst + off + HALF, tl.load(v_src + off + HALF, mask=ok, other=0.0), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], or a split-K projection's float32 partials [P, T, H] (kernels/skinny_gemm.py): their
    sum rounds to the residual's dtype (the weight's without one) before the add. rows [B] (int64
    row numbers in T): only those rows, in that order -> [B, H] each (the forward's last rows)."""
    parts = x.shape[0] if x.dim() == 3 else 1
    tokens, hidden = x.shape[-2:]
    out_rows = tokens if rows is None else rows.shape[0]
    dtype = x.dtype if parts == 1 else (residual if residual is not None else weight).dtype
    y = torch.empty((out_rows, hidden), dtype=dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None or parts > 1 or rows is not None else x
    _add_rms_norm_kernel[(out_rows,)](x, residual if residual is not None else x, weight, y, s,
                                      rows if rows is not None else y, tokens, hidden, eps,
                                      HAS_RES=residual is not None, PARTS=parts, BLOCK=triton.next_power_of_2(hidden),
                                      GATHER=rows is not None, **pdl.launch_kwargs(x.device))
    return y, s


def qk_norm_rope_kv_triton(qkv, q_weight, k_weight, eps, cos, sin, positions, k_cache, v_cache, out_slots,
                           num_heads: int, num_kv_heads: int) -> torch.Tensor:
    tokens = qkv.shape[0]
    d = k_cache.shape[-1]
    if d % 2 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for the fused kernel, got {d}")
    q = torch.empty((tokens, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    _qk_norm_rope_kv_kernel[(tokens,)](
        qkv, q_weight, k_weight, cos, sin, positions, out_slots, q, k_cache, v_cache, eps, num_heads,
        num_kv_heads, HQ=triton.next_power_of_2(num_heads), HKV=triton.next_power_of_2(num_kv_heads),
        HALF=d // 2, **pdl.launch_kwargs(qkv.device))
    return q


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    tokens, two_inter = gate_up.shape
    inter = two_inter // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(4096, triton.next_power_of_2(inter))
    _silu_mul_kernel[(tokens, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block,
                                                         **pdl.launch_kwargs(gate_up.device))
    return out

"""Paged decode attention: one new query token per sequence attends to its K/V read straight from
the paged L1 pool through the page table (no gather copy), split over the sequence (flash-decoding)
so that even batch 1 fills the GPU; a second kernel merges the splits. Shapes are static given the
batch size, so a decode step can be captured in a CUDA graph.

  q:           [B, Hq, D]
  k_layer:     [P, S, Hkv, D]   (kv_pool[0, layer]; v_layer likewise)
  page_tables: [B, max_pages] int64
  seq_lens:    [B] int64        (keys per sequence, the new token included)
  out:         [B, Hq, D]
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency; guard for odd installs
    triton = None

NUM_SPLITS = 16
BLOCK_N = 32


def decode_attention_torch(q, k_layer, v_layer, page_tables, seq_lens, scale: float) -> torch.Tensor:
    """Reference: gather every sequence's pages, mask past seq_len, softmax attention."""
    b, hq, d = q.shape
    _, s, hkv, _ = k_layer.shape
    max_tokens = page_tables.shape[1] * s
    k = k_layer[page_tables].reshape(b, max_tokens, hkv, d)  # [B, N, Hkv, D]
    v = v_layer[page_tables].reshape(b, max_tokens, hkv, d)
    group = hq // hkv
    k = k.repeat_interleave(group, dim=2).float()  # [B, N, Hq, D]
    v = v.repeat_interleave(group, dim=2).float()
    scores = torch.einsum("bhd,bnhd->bhn", q.float(), k) * scale  # [B, Hq, N]
    valid = torch.arange(max_tokens, device=q.device)[None, :] < seq_lens[:, None]  # [B, N]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhn,bnhd->bhd", torch.softmax(scores, dim=-1), v).to(q.dtype)


if triton is not None:
    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, len_ptr, part_o_ptr, part_m_ptr, part_l_ptr,
                      scale, max_pages, num_kv_heads, num_q_heads,
                      PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                      BLOCK: tl.constexpr, SPLITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(len_ptr + b).to(tl.int64)
        per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK) * BLOCK
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)
        rows = tl.arange(0, GROUP_PAD)
        row_ok = rows < GROUP
        dims = tl.arange(0, D)
        q_heads = h * GROUP + rows
        q = tl.load(q_ptr + (b * num_q_heads + q_heads)[:, None] * D + dims[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)  # [G, D]
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for n0 in range(start, end, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            ok = n < end
            page = tl.load(pt_ptr + b * max_pages + n // PAGE, mask=ok, other=0)
            slot = page.to(tl.int64) * PAGE + n % PAGE
            kv_off = (slot * num_kv_heads + h)[:, None] * D + dims[None, :]  # [N, D]
            k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G, N], exact fp32
            scores = tl.where(ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        base = (b * num_kv_heads + h) * SPLITS + split
        tl.store(part_o_ptr + (base * GROUP_PAD + rows)[:, None] * D + dims[None, :], acc)
        tl.store(part_m_ptr + base * GROUP_PAD + rows, m)
        tl.store(part_l_ptr + base * GROUP_PAD + rows, l)

    @triton.jit
    def _merge_kernel(part_o_ptr, part_m_ptr, part_l_ptr, out_ptr, num_kv_heads, num_q_heads,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, D)
        splits = tl.arange(0, SPLITS)
        base = (b * num_kv_heads + h) * SPLITS + splits  # [SPLITS]
        m = tl.load(part_m_ptr + base[:, None] * GROUP_PAD + rows[None, :])  # [SPLITS, G]
        l = tl.load(part_l_ptr + base[:, None] * GROUP_PAD + rows[None, :])
        m_max = tl.max(m, axis=0)  # [G]
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max[None, :]))  # empty splits weigh 0
        denom = tl.sum(l * w, axis=0)  # [G]
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for s in range(SPLITS):
            o = tl.load(part_o_ptr + ((b * num_kv_heads + h) * SPLITS + s) * GROUP_PAD * D
                        + rows[:, None] * D + dims[None, :])  # [G, D]
            ws = tl.sum(tl.where(splits[:, None] == s, w, 0.0), axis=0)  # [G]
            acc += o * ws[:, None]
        out = acc / denom[:, None]
        row_ok = rows < GROUP
        tl.store(out_ptr + (b * num_q_heads + h * GROUP + rows)[:, None] * D + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def decode_attention_triton(q, k_layer, v_layer, page_tables, seq_lens, scale: float,
                            workspace: dict | None = None) -> torch.Tensor:
    b, hq, d = q.shape
    _, page, hkv, _ = k_layer.shape
    group = hq // hkv
    group_pad = max(16, triton.next_power_of_2(group))
    ws = workspace if workspace is not None else {}
    key = (b, hkv, group_pad, d, q.device)
    if ws.get("key") != key:  # reused across layers and graph replays
        ws["key"] = key
        ws["o"] = torch.empty((b, hkv, NUM_SPLITS, group_pad, d), dtype=torch.float32, device=q.device)
        ws["m"] = torch.empty((b, hkv, NUM_SPLITS, group_pad), dtype=torch.float32, device=q.device)
        ws["l"] = torch.empty((b, hkv, NUM_SPLITS, group_pad), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _split_kernel[(b, hkv, NUM_SPLITS)](
        q, k_layer, v_layer, page_tables, seq_lens, ws["o"], ws["m"], ws["l"], scale,
        page_tables.shape[1], hkv, hq, PAGE=page, GROUP=group, GROUP_PAD=group_pad, D=d,
        BLOCK=BLOCK_N, SPLITS=NUM_SPLITS)
    _merge_kernel[(b, hkv)](ws["o"], ws["m"], ws["l"], out, hkv, hq, GROUP=group, GROUP_PAD=group_pad,
                            D=d, SPLITS=NUM_SPLITS)
    return out

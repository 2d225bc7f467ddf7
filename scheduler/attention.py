"""Attention over the paged L1 pool.

Pool layout (DESIGN.md section 3, fixed): kv_pool [2 (K/V), layer, page, token_in_page, kv_head, head_dim].
A token at position p of a sequence lives in page page_table[p // S] at offset p % S (S = page size).

Two paths:
- prefill: one page gather (index_select on the page dim) per layer for the whole batch, then one SDPA
  per sequence whose queries are its new tokens and whose keys are positions [0, prefix + new) with a
  bottom-right-aligned causal mask;
- decode (every new_len == 1, and the new_len == 1 rows of a prefill batch): one batched gather of
  [B, max_pages * S] keys, a length mask and one SDPA; tensor ops only (no host sync, no per-sequence
  Python), so a whole decode step can be captured in a CUDA graph.

The pool must hold finite values everywhere (allocate it with torch.zeros): padded page-table entries
(a sequence's own first page) and the tail of a sequence's last page are read and masked, and NaN * 0
is still NaN (a request whose logits went NaN has its private pages zeroed: Admission._fail_nan).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels.decode_attention import decode_attention_triton


@dataclass
class _PrefillPlan:
    """Host-side plan of a prefill batch, built once per batch and reused by every layer."""
    seqs: list[tuple[int, int, int, int]]  # (q_start_row, new_len, prefix_len, first_token_in_gather)
    pages: torch.Tensor | None  # [sum pages of multi-token seqs] int64: their pages, concatenated
    single_rows: torch.Tensor | None  # [B1] rows in T of new_len == 1 sequences
    single_seqs: torch.Tensor | None  # [B1] their sequence index in the batch


@dataclass
class AttentionBatch:
    is_decode: bool
    prefix_lens: list[int]  # tokens already in the pool before this step, per sequence
    new_lens: list[int]  # tokens computed this step, per sequence
    page_tables: torch.Tensor  # [B, max_pages] int64: pages covering prefix + new, padded with the first
    seq_lens: torch.Tensor  # [B] int64: prefix + new
    out_slots: torch.Tensor  # [T] int64: page * S + offset of each new token, T = sum(new_lens)
    positions: torch.Tensor  # [T] int64: position of each new token in its sequence
    last_rows: torch.Tensor | None = None  # [B] int64: row in T of each sequence's last new token
    # decode only: R query rows per sequence (a captured short tail; rows B*R, seq_lens per row [B*R],
    # page_tables per sequence [B, max_pages], last_rows [B] if only those rows' logits are wanted);
    # 1 = plain decode
    rows_per_seq: int = 1
    _plan: _PrefillPlan | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def logit_rows(self) -> torch.Tensor | None:
        """The rows whose logits a forward returns ([B] row numbers in T), or None for every row: a
        plain decode batch (one row per sequence), or rows of a tail batch given no last rows."""
        return None if self.is_decode and (self.rows_per_seq == 1 or self.last_rows is None) else self.last_rows

    @classmethod
    def build(cls, prefix_lens: list[int], new_lens: list[int], page_tables_list: list[list[int]],
              page_size: int, device: torch.device | str, is_decode: bool) -> "AttentionBatch":
        """Builds every tensor on the host and moves each once to `device`."""
        if not (len(prefix_lens) == len(new_lens) == len(page_tables_list)) or not new_lens:
            raise ValueError("prefix_lens, new_lens and page_tables_list must be non-empty and of equal length")
        if is_decode and any(n != 1 for n in new_lens):
            raise ValueError(f"a decode batch has new_len == 1 everywhere, got {new_lens}")
        max_pages = max(len(pt) for pt in page_tables_list)
        slots: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        for prefix, new, pages in zip(prefix_lens, new_lens, page_tables_list):
            if new < 1 or prefix < 0:
                raise ValueError(f"need new_len >= 1 and prefix_len >= 0, got {new}, {prefix}")
            if len(pages) * page_size < prefix + new:
                raise ValueError(f"{len(pages)} pages of {page_size} tokens cannot hold {prefix + new} tokens")
            for pos in range(prefix, prefix + new):
                slots.append(pages[pos // page_size] * page_size + pos % page_size)
                positions.append(pos)
            last_rows.append(len(slots) - 1)
        # padded with the sequence's own first page: the padding is read (and masked), so page 0 let a
        # request whose forward went NaN there make the batch's shorter sequences NaN too
        padded = [pt + pt[:1] * (max_pages - len(pt)) for pt in page_tables_list]

        def dev(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        return cls(is_decode=is_decode, prefix_lens=list(prefix_lens), new_lens=list(new_lens),
                   page_tables=dev(padded), seq_lens=dev([p + n for p, n in zip(prefix_lens, new_lens)]),
                   out_slots=dev(slots), positions=dev(positions), last_rows=dev(last_rows))

    def plan(self, page_size: int) -> _PrefillPlan:
        if self._plan is None:
            self._plan = _make_plan(self, page_size)
        return self._plan


def _make_plan(batch: AttentionBatch, page_size: int) -> _PrefillPlan:
    seqs, page_slices, single_rows, single_seqs = [], [], [], []
    row = token = 0
    for b, (prefix, new) in enumerate(zip(batch.prefix_lens, batch.new_lens)):
        if new == 1:
            single_rows.append(row)
            single_seqs.append(b)
        else:
            num_pages = -(-(prefix + new) // page_size)
            seqs.append((row, new, prefix, token))
            page_slices.append(batch.page_tables[b, :num_pages])
            token += num_pages * page_size
        row += new
    dev = batch.page_tables.device

    def idx(values: list[int]) -> torch.Tensor | None:
        return torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True) if values else None

    return _PrefillPlan(seqs=seqs, pages=torch.cat(page_slices) if page_slices else None,
                        single_rows=idx(single_rows), single_seqs=idx(single_seqs))


def write_kv(kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             out_slots: torch.Tensor) -> None:
    """Stores new keys/values. k, v: [T, Hkv, D]; out_slots: [T] int64 (page * S + offset)."""
    _, _, num_pages, page_size, num_kv_heads, head_dim = kv_pool.shape
    flat_shape = (num_pages * page_size, num_kv_heads, head_dim)
    kv_pool[0, layer].view(flat_shape).index_copy_(0, out_slots, k)  # view: raises if the pool is not dense
    kv_pool[1, layer].view(flat_shape).index_copy_(0, out_slots, v)


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, page_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence, tensor ops only (CUDA-graph capturable).

    q: [B, Hq, D]; kv_layer: [2, P, S, Hkv, D]; page_tables: [B, M]; seq_lens: [B] -> [B, Hq, D].
    """
    batch, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_layer.shape
    max_tokens = page_tables.shape[1] * page_size
    kv = kv_layer.index_select(1, page_tables.reshape(-1))  # [2, B*M, S, Hkv, D]
    kv = kv.view(2, batch, max_tokens, num_kv_heads, head_dim).transpose(2, 3)  # [2, B, Hkv, N, D]
    token = torch.arange(max_tokens, device=q.device)  # [N]
    # key 0 always visible: a padded row (seq_len 0) then yields finite garbage instead of NaN
    visible = (token[None, :] < seq_lens[:, None]) | (token[None, :] == 0)  # [B, N]
    # GQA without repeating K/V: the G query heads of one KV head become G query rows of it
    group = num_heads // num_kv_heads
    qg = q.reshape(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=visible[:, None, None, :],
                                         scale=scale)  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim)


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                 scale: float) -> torch.Tensor:
    """q: [Tn, Hq, D]; k, v: [prefix + Tn, Hkv, D] -> [Tn, Hq, D], bottom-right causal."""
    new_len = q.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, n, D]
    if prefix_len == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        bias = causal_lower_right(new_len, prefix_len + new_len)  # flash / mem-efficient on CUDA
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [Tn, Hq, D]


def paged_attention(q: torch.Tensor, kv_pool: torch.Tensor, layer: int, batch: AttentionBatch,
                    scale: float, wait=None) -> torch.Tensor:
    """q: [T, Hq, D] (the new tokens, batch order) -> [T, Hq, D]. The new K/V must already be written.
    wait (kernels/layer_flags.LayerWait): first wait for this layer of a restore still landing; the
    paged decode kernel spins on it itself, other paths run the wait kernel before."""
    kv_layer = kv_pool[:, layer]  # [2, P, S, Hkv, D]
    if batch.is_decode and q.is_cuda:  # paged flash-decoding: reads K/V through the page table, no gather
        return decode_attention_triton(q, kv_pool[0, layer], kv_pool[1, layer], batch.page_tables,
                                       batch.seq_lens, scale, batch.rows_per_seq,
                                       wait=wait.kernel_args(layer) if wait is not None else None)
    if wait is not None:
        wait(layer)
    if batch.is_decode:
        return decode_attention(q, kv_layer, batch.page_tables.repeat_interleave(batch.rows_per_seq, dim=0),
                                batch.seq_lens, scale)
    _, _, page_size, num_kv_heads, head_dim = kv_layer.shape
    plan = batch.plan(page_size)
    out = torch.empty_like(q) if len(plan.seqs) != 1 or plan.single_rows is not None else None
    if plan.pages is not None:
        kv = kv_layer.index_select(1, plan.pages).view(2, -1, num_kv_heads, head_dim)  # [2, sum_pages*S, Hkv, D]
        for row, new_len, prefix_len, token in plan.seqs:
            n = prefix_len + new_len
            o = _prefill_one(q[row:row + new_len], kv[0, token:token + n], kv[1, token:token + n],
                             prefix_len, scale)
            if out is None:
                return o
            out[row:row + new_len] = o
    if plan.single_rows is not None:
        out[plan.single_rows] = decode_attention(
            q.index_select(0, plan.single_rows), kv_layer, batch.page_tables.index_select(0, plan.single_seqs),
            batch.seq_lens.index_select(0, plan.single_seqs), scale)
    return out

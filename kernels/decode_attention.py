"""Paged decode attention: a few new query tokens per sequence attend to their K/V read straight from
the paged L1 pool through the page table (no gather copy), split over the sequence (flash-decoding)
so that even batch 1 fills the GPU; a second kernel merges the splits. Shapes are static given the
batch size, so a decode step can be captured in a CUDA graph.

`rows_per_seq` (R) query tokens of one sequence share one program per (sequence, KV head, split): each
K/V block is loaded once for all R x G query rows (G = query heads per KV head), and every row sees
keys below its own length (causal). R = 1 is plain decode; R > 1 is the short tail left to compute
after a restore (a prefix that is not page-aligned), which would otherwise read the whole KV once per
token.

  q:           [B * R, Hq, D]
  k_layer:     [P, S, Hkv, D]   (kv_pool[0, layer]; v_layer likewise)
  page_tables: [B, max_pages] int64
  seq_lens:    [B * R] int64    (keys each row sees, itself included; padding rows: any value >= 1)
  out:         [B * R, Hq, D]
"""
from __future__ import annotations

import functools

import torch

from kernels import pdl

try:
    import triton
    import triton.language as tl

    from kernels.layer_flags import spin_wait
except ImportError:  # pragma: no cover - triton is a dependency; guard for odd installs
    triton = None

NUM_SPLITS = 16  # default splits of the sequence (flash-decoding); see decode_attention_triton
BLOCK_N = 32
# query rows per merge program: with the splits' loads unrolled, [4 rows x D] per split keeps every
# load in registers (16 splits x 4 x 128 float32 over 128 threads), and a 16-row tail gets 16
# programs per KV head instead of 4 (the merge went from 6.1 to 4.4 us a layer on the H200)
MERGE_ROWS = 4
# multi-row tails' attention launched with PDL (kernels/pdl.py), its split kernel spread one program
# an SM, unless it waits for a restore's layers (see decode_attention_triton);
# scripts/probe_graph_ab.py's pdl_off_tail_attn turns it off
TAIL_PDL = True
# a split kernel of one wave launched with PDL asks for more than half an SM's shared memory, so no SM
# runs two of its programs (kernels/pdl.py spread); probe_graph_ab.py's unspread turns it off
SPREAD_SPLITS = True


def decode_attention_torch(q, k_layer, v_layer, page_tables, seq_lens, scale: float,
                           rows_per_seq: int = 1) -> torch.Tensor:
    """Reference: gather every row's pages, mask past its seq_len, softmax attention."""
    page_tables = page_tables.repeat_interleave(rows_per_seq, dim=0)  # [B * R, M]
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
    @triton.jit(do_not_specialize=["layer", "max_spins"])
    def _split_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, len_ptr, part_o_ptr, part_m_ptr, part_l_ptr,
                      flags_ptr, expected_ptr, status_ptr, layer, max_spins,
                      scale, max_pages, num_kv_heads, num_q_heads,
                      PAGE: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, M_PAD: tl.constexpr,
                      D: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr, TENSOR_CORES: tl.constexpr,
                      WAIT: tl.constexpr, PDL: tl.constexpr, PREFETCH_PAGES: tl.constexpr):
        """Program (sequence, KV head, split): its share of the keys in BLOCK steps, online softmax.
        Triton software-pipelines the loop (asynchronous copies; Triton 3.6 on the H200), and with 3
        stages the block's page numbers too, but a block's K/V copies can only be issued once its
        page numbers have landed. PREFETCH_PAGES instead loads the next block's page numbers into
        registers during this step, one block ahead of its K/V: faster for decode and tails alike
        (decode_attention_triton)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        if PDL:  # kernels/pdl.py: q (and this layer's new K/V) come from the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if WAIT:  # the layer's K/V may still be crossing PCIe: spin on its flag
            spin_wait(flags_ptr, expected_ptr, status_ptr, layer, max_spins)
        rows = tl.arange(0, M_PAD)  # query row r = token (r // GROUP) of this sequence, head h*GROUP + r % GROUP
        row_ok = rows < ROWS * GROUP
        token_row = b * ROWS + rows // GROUP  # row of q / seq_lens
        row_len = tl.load(len_ptr + token_row, mask=row_ok, other=0).to(tl.int64)  # [M]
        seq_len = tl.max(row_len, axis=0)
        row_len = tl.where(row_ok, row_len, seq_len)  # padding rows: q = 0, see every key (finite)
        per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK) * BLOCK
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)
        dims = tl.arange(0, D)
        q_off = (token_row * num_q_heads + h * GROUP + rows % GROUP)[:, None] * D + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)  # [M, D]
        if not TENSOR_CORES:
            q = q.to(tl.float32)
        m = tl.full([M_PAD], float("-inf"), tl.float32)
        l = tl.zeros([M_PAD], tl.float32)
        acc = tl.zeros([M_PAD, D], tl.float32)
        if PREFETCH_PAGES:
            n = start + tl.arange(0, BLOCK)
            page = tl.load(pt_ptr + b * max_pages + n // PAGE, mask=n < end, other=0)  # [N]
        for n0 in range(start, end, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            ok = n < end
            if not PREFETCH_PAGES:
                page = tl.load(pt_ptr + b * max_pages + n // PAGE, mask=ok, other=0)
            slot = page.to(tl.int64) * PAGE + n % PAGE
            if PREFETCH_PAGES:  # the next block's: in flight while this block computes
                page = tl.load(pt_ptr + b * max_pages + (n + BLOCK) // PAGE, mask=n + BLOCK < end, other=0)
            kv_off = (slot * num_kv_heads + h)[:, None] * D + dims[None, :]  # [N, D]
            k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0)
            if TENSOR_CORES:  # 16-bit inputs: exact products, float32 accumulation
                scores = tl.dot(q, tl.trans(k)) * scale  # [M, N]
            else:  # float32 inputs: exact fp32 (no TF32)
                k, v = k.to(tl.float32), v.to(tl.float32)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            scores = tl.where(ok[None, :] & (n[None, :] < row_len[:, None]), scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
            alpha = tl.exp(m - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if TENSOR_CORES:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        base = (b * num_kv_heads + h) * SPLITS + split
        tl.store(part_o_ptr + (base * M_PAD + rows)[:, None] * D + dims[None, :], acc)
        tl.store(part_m_ptr + base * M_PAD + rows, m)
        tl.store(part_l_ptr + base * M_PAD + rows, l)

    @triton.jit
    def _merge_kernel(part_o_ptr, part_m_ptr, part_l_ptr, out_ptr, num_kv_heads, num_q_heads,
                      GROUP: tl.constexpr, ROWS: tl.constexpr, M_PAD: tl.constexpr, RB: tl.constexpr, D: tl.constexpr,
                      SPLITS: tl.constexpr, PDL: tl.constexpr):
        """One program per (sequence, KV head, block of RB query rows): real rows only. The loop over
        the splits is unrolled, so every split's partial load is in flight at once."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(2) * RB + tl.arange(0, RB)
        row_ok = rows < ROWS * GROUP
        dims = tl.arange(0, D)
        splits = tl.arange(0, SPLITS)
        base = (b * num_kv_heads + h) * SPLITS + splits  # [SPLITS]
        ml_off = base[:, None] * M_PAD + rows[None, :]  # [SPLITS, RB]
        m = tl.load(part_m_ptr + ml_off, mask=row_ok[None, :], other=float("-inf"))
        l = tl.load(part_l_ptr + ml_off, mask=row_ok[None, :], other=0.0)
        m_max = tl.max(m, axis=0)  # [RB]
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # padding rows: no NaN from -inf - -inf
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max[None, :]))  # empty splits weigh 0
        denom = tl.sum(l * w, axis=0)  # [RB]
        acc = tl.zeros([RB, D], tl.float32)
        for s in tl.static_range(SPLITS):
            o = tl.load(part_o_ptr + ((b * num_kv_heads + h) * SPLITS + s) * M_PAD * D
                        + rows[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)  # [RB, D]
            ws = tl.sum(tl.where(splits[:, None] == s, w, 0.0), axis=0)  # [RB]
            acc += o * ws[:, None]
        out = acc / tl.where(row_ok, denom, 1.0)[:, None]
        token_row = b * ROWS + rows // GROUP
        tl.store(out_ptr + (token_row * num_q_heads + h * GROUP + rows % GROUP)[:, None] * D + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def default_splits(pairs: int, rows_per_seq: int) -> int:
    """Splits of each (sequence, KV head)'s keys, given how many such pairs a call has. A one-row decode of
    many sequences has programs enough with fewer splits, and each split's loop is then long enough to keep
    its K/V loads in flight: at the 8B shape (8 KV heads) on the H200, us a layer at 576 / 2,000 / 4,000 keys
    (scripts/bench_kernels.py --attention-batch, session 50): 8 sequences 14.3 / 28.9 / 47.4 with 16 splits,
    10.8 / 23.3 / 38.4 with 8; 16 sequences 18.4 / 44.2 / 76.5 with 8, 15.0 / 37.8 / 67.6 with 4; 32
    sequences 31.5 / 80.5 / 144.3 with 8, 29.9 / 75.7 / 142.0 with 4; 64 about even. Fewer still (1 or 2)
    was slower at every shape: too few keys in flight per program. Multi-row tails keep NUM_SPLITS."""
    if rows_per_seq > 1 or pairs <= 32:
        return NUM_SPLITS
    return NUM_SPLITS // 2 if pairs <= 64 else NUM_SPLITS // 4


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def takes_head_dim(head_dim: int) -> bool:
    """Whether the kernels run heads of `head_dim`: a power of two (tl.arange's range) of at least 16 (tl.dot's
    smallest K for 16-bit inputs on NVIDIA's GPUs)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def decode_attention_triton(q, k_layer, v_layer, page_tables, seq_lens, scale: float,
                            rows_per_seq: int = 1, tensor_cores: bool | None = None, block: int | None = None,
                            num_warps: int | None = None, splits: int | None = None,
                            wait: tuple | None = None, merge_rows: int = MERGE_ROWS,
                            num_stages: int | None = None, prefetch_pages: bool = True) -> torch.Tensor:
    """tensor_cores (default: for 16-bit inputs) runs both dots on tensor cores with float32
    accumulation, the probabilities rounded to the input dtype for the second; float32 inputs use
    exact fp32 dots. block / num_warps / splits / merge_rows / num_stages (the split kernel's software
    pipelining of its K/V loop; default Triton's, 3 on sm_90) / prefetch_pages (the next block's page
    numbers loaded while a block computes: the split kernel's docstring) override the tuned defaults
    (benchmarks).
    wait = (flags, expected, status, layer, max_spins): every program first waits, on the device,
    for that layer of a layer-ordered restore (kernels/layer_flags.py): no wait kernel before it."""
    rows, hq, d = q.shape
    b = page_tables.shape[0]
    if rows != b * rows_per_seq or seq_lens.shape[0] != rows:
        raise ValueError(f"q has {rows} rows, page_tables {b} sequences x {rows_per_seq} rows, "
                         f"seq_lens {seq_lens.shape[0]}")
    _, page, hkv, _ = k_layer.shape
    group = hq // hkv
    m_pad = max(16, triton.next_power_of_2(group * rows_per_seq))
    # tuned on the H200 at the 8B shape (scripts/bench_kernels.py, docs/benchmarks.md): one query row
    # per sequence and few programs -> 16 splits of 64-key blocks, 8 warps; many sequences -> 8 or 4 splits
    # (default_splits); multi-row tails -> 16 splits of 32-key blocks, 4 warps
    few_programs = rows_per_seq == 1 and b * hkv <= 32
    num_splits = splits or default_splits(b * hkv, rows_per_seq)
    block = block or (64 if few_programs else BLOCK_N)
    num_warps = num_warps or (8 if few_programs else 4)
    # the page prefetch, with Triton's 3 stages (H200, us a call over 36 layers' distinct K/V, session
    # 24, scripts/bench_kernels.py --attention): one-row decode 14.8 -> 12.4 at 3,500 keys, 23.0 ->
    # 17.9 at 8,000, batch 32 at 1,000 keys 49.5 -> 45.4; a 16-row tail 8.2 / 9.9 / 17.1 / 31.1 ->
    # 8.5 / 9.6 / 13.2 / 20.7 at 350 / 1,000 / 3,500 / 8,000 keys, against its former 2 stages without
    # it (3 stages without it: 8.7 / 10.6 / 18.6 / 33.8; the tail graph serves every length)
    part_o = torch.empty((b, hkv, num_splits, m_pad, d), dtype=torch.float32, device=q.device)
    part_m = torch.empty((b, hkv, num_splits, m_pad), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    out = torch.empty_like(q)
    if tensor_cores is None:
        tensor_cores = q.dtype in (torch.bfloat16, torch.float16) and q.is_cuda
    flags, expected, status, layer, max_spins = wait if wait is not None else (part_m, part_m, part_m, 0, 0)
    # PDL (kernels/pdl.py). A multi-row tail's split kernel (64 KiB of shared memory, three programs
    # an SM) launched early made the tail forward slower the longer the context (H200, 8B, a 16-row
    # tail graph, device ms, session 25: 4.58 / 4.62 / 4.68 / 4.77 / 5.01 the ordinary way against
    # 4.58 / 4.65 / 4.73-4.81 / 4.85-4.91 / 5.22-5.49 at 350 / 1,000 / 2,000 / 3,500 / 8,000 keys):
    # some SMs took two of its programs, whose key loops then ran at half speed. Spread one program
    # an SM (asking for 128 KiB), the early launch is faster than the ordinary one at every length:
    # 4.46 / 4.51 / 4.64 / 4.89 against 4.50 / 4.55 / 4.68 / 4.93 ms at 350 / 1,000 / 3,500 /
    # 8,000 keys, 100 KiB (two an SM) as slow as 64 (session 28). A tail that waits for its layers
    # of a restore (wait) keeps the ordinary launch, unspread: its programs spin on the layer flags
    # while the restore's copies run, and its ordinary launch is what every restore was measured
    # with. The stress workload ran 1.77 / 1.65 x hicache off with this, 1.77 / 1.69 x without
    # (two processes each, alternating: the spread between processes; session 28).
    tail_pdl = TAIL_PDL and wait is None
    launch = pdl.launch_kwargs(q.device) if rows_per_seq == 1 or tail_pdl else {"PDL": False}
    split = _split_kernel[(b, hkv, num_splits)](
        q, k_layer, v_layer, page_tables, seq_lens, part_o, part_m, part_l, flags, expected, status, layer,
        max_spins, scale, page_tables.shape[1], hkv, hq, PAGE=page, GROUP=group, ROWS=rows_per_seq, M_PAD=m_pad,
        D=d, BLOCK=block, SPLITS=num_splits, TENSOR_CORES=tensor_cores, WAIT=wait is not None,
        PREFETCH_PAGES=prefetch_pages,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}), **launch)
    if launch["PDL"] and SPREAD_SPLITS and wait is None and b * hkv * num_splits <= _sm_count(q.device):
        pdl.spread(split, q.device)  # from the next launch on (a graph's warm-up runs before its capture)
    real_rows = group * rows_per_seq
    rb = min(merge_rows, triton.next_power_of_2(real_rows))
    _merge_kernel[(b, hkv, triton.cdiv(real_rows, rb))](part_o, part_m, part_l, out, hkv, hq, GROUP=group,
                                                        ROWS=rows_per_seq, M_PAD=m_pad, RB=rb, D=d, SPLITS=num_splits,
                                                        **launch)
    return out

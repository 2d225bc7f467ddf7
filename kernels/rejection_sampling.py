"""Top-p / top-k / min_p sampling without a sort: one program a row, rejection rounds over the row.

`scheduler/sampling.py` draws a batch's sampled rows as vLLM V1 does: temperature, min_p, top-k,
top-p, then one draw. Its torch path sorts the whole batch for top-k/top-p ([32, 151,936] on the
H200: most of the ~1 ms a sampled decode step costs over a greedy one). This kernel draws the same
distribution without sorting (the idea of FlashInfer's sampling kernels):

  1. one pass: the row's largest logit m and round 0's draw t among all
     tokens by the exponential race (argmax of x - log q, q ~ Exp(1), x = (l - m) / T; kept per lane
     as (l, log q) pairs, so it needs no m);
  2. a pass over what is likelier than t: t is kept iff min_p keeps it, fewer than k tokens are
     likelier (top-k) and their mass is below top_p times the mass min_p and top-k keep (top-p of the
     top-k set, as the sort renormalizes it; the likeliest always). Kept: t is
     the draw (two passes in all). Not kept: every token no likelier than t is out too (each set is
     closed upwards), so a race among the tokens likelier than t (a pass) draws the next t, and again.

A draw from a superset, kept only when it lands in the set, is a draw from the set: the result has
exactly the distribution of the sort-based path. Ties differ only in which of a tie at the edge of
the nucleus is kept: here all of it, there the sort's choice (vLLM's too). The likeliest token is
always accepted, so a round never lacks a candidate; each rejection removes about half of what is
left (in expectation e-fold of the mass), so races are ~1 for a top_p near 1 and ~ln(1 / top_p)
for small ones. After MAX_ROUNDS rejections (not met in practice) the likeliest token is taken.

A row with both top-k and top-p needs the top-k set's mass before its first test: the caller finds the
row's k-th likeliest logit (`set_kth_logits`, torch.topk: a partial selection, not a sort) and every
token below it counts as min_p's rejects do (ties with it kept, as the sort keeps them). Randomness: a counter hash (`_uniform`) keyed by a per-row 64-bit seed the
caller draws from the row's generator, the counter the round and the token: a seeded row's draw does
not depend on its batch. Runs on the CPU under TRITON_INTERPRET=1 in tests.
"""
from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    triton = None

MAX_ROUNDS = 64
BLOCK = 2048  # tokens a program handles per step of its loop over the row (fewer for a small vocabulary)
NUM_WARPS = 16  # (the fastest of scripts/probe_sample.py --sweep on the H200 at every batch, session 36)
NUM_STAGES = 1

if triton is not None:
    # (a jit function reads a module global only as a constexpr; the interpreter reads any: session 36)
    _LOWEST, _HIGHEST = tl.constexpr(-3.4028234663852886e38), tl.constexpr(3.4028234663852886e38)  # float32's range
    # the least Exp(1) draw: -log(1 - u) of the least nonzero uniform (2**-24); u = 0 (once in 2**24 tokens)
    # counts as that (regression: clamped at float32's smallest normal, its log, -87, let a token of any
    # probability win about one race in a hundred over 151,936 tokens; torch's exponential_ never goes below ~2**-25)
    _SMALLEST = tl.constexpr(5.960464477539063e-08)
    _MUL_1, _MUL_2 = tl.constexpr(0x7FEB352D), tl.constexpr(0x846CA68B)

    @triton.jit
    def _hash32(x):
        """A 32-bit integer hash with full avalanche (Chris Wellons' lowbias32): x uint32 -> uint32."""
        x ^= x >> 16
        x *= _MUL_1
        x ^= x >> 15
        x *= _MUL_2
        return x ^ (x >> 16)

    @triton.jit
    def _uniform(counter, key_lo, key_hi):
        """A uniform in [0, 1) (24 bits) for each counter (uint32) under the row's 64-bit key: two hashes,
        ~16 integer operations where Philox-4x32-10 costs ~50 a number (the kernel ran no faster for it on
        the H200, session 36: a program streaming a whole row is the bound; kept as the simpler stream,
        checked against a Python reference on both devices)."""
        return (_hash32(_hash32(counter ^ key_lo) ^ key_hi) >> 8).to(tl.float32) * (1.0 / 16777216.0)

    @triton.jit
    def _clean(logits_row, offs, ok):
        """The logits of tokens `offs` in float32, NaN counted as float32's lowest and +-inf as its
        largest / lowest (torch.nan_to_num, as the torch path); out-of-row tokens the lowest."""
        lg = tl.load(logits_row + offs, mask=ok, other=_LOWEST).to(tl.float32)
        lg = tl.where(lg != lg, _LOWEST, lg)
        return tl.minimum(tl.maximum(lg, _LOWEST), _HIGHEST)

    @triton.jit
    def _tempered(logits_row, offs, ok, m, temperature):
        """x = (l - m) / T for tokens `offs` of the row (`_clean`'s l); out-of-row tokens -inf."""
        return tl.where(ok, (_clean(logits_row, offs, ok) - m) / temperature, -float("inf"))

    @triton.jit
    def _first_pass(logits_row, offs, V, temperature, u, run_m, run_idx, best_l, best_lq, best_idx):
        """Pass 1 over tokens `offs`: the running max and where it is, and the exponential
        race among all tokens kept as (l, log q) per lane: t beats the lane's best b iff
        (l_t - l_b) / T > log q_t - log q_b, which needs no max (l / T itself overflows for a tiny T)."""
        ok = offs < V
        lg = _clean(logits_row, offs, ok)
        lq = tl.log(tl.maximum(-tl.log(1.0 - u), _SMALLEST))  # log q, q ~ Exp(1)
        better = ok & ((lg - best_l) / temperature > lq - best_lq)
        above = ok & (lg > run_m)
        return (tl.where(above, lg, run_m), tl.where(above, offs, run_idx), tl.where(better, lg, best_l), tl.where(better, lq, best_lq),
                tl.where(better, offs, best_idx))

    @triton.jit
    def _sample_rows_kernel(logits_ptr, row_stride, params_ptr, out_ptr, S, V,
                            BLOCK: tl.constexpr, MAX_ROUNDS: tl.constexpr):
        """Program s: a draw from logits row params[4, s] into out[s]. params [8, S] int32: temperature,
        top_p, log(min_p) (-inf: off), top_k (0: off) as float32 bits, the row, the 64-bit seed's low and
        high halves, the row's k-th likeliest logit as float32 bits (-inf: unknown; `set_kth_logits`). Every pass reads the row a block at a time as four independent quarter blocks (more
        loads in flight: one program streams a row alone)."""
        s = tl.program_id(0)
        temperature = tl.load(params_ptr + s).to(tl.float32, bitcast=True)
        top_p = tl.load(params_ptr + S + s).to(tl.float32, bitcast=True)
        min_log = tl.load(params_ptr + 2 * S + s).to(tl.float32, bitcast=True)
        top_k = tl.load(params_ptr + 3 * S + s).to(tl.float32, bitcast=True)
        logits_row = logits_ptr + tl.load(params_ptr + 4 * S + s).to(tl.int64) * row_stride
        key_lo = tl.load(params_ptr + 5 * S + s).to(tl.uint32, bitcast=True)
        key_hi = tl.load(params_ptr + 6 * S + s).to(tl.uint32, bitcast=True)
        kth = tl.load(params_ptr + 7 * S + s).to(tl.float32, bitcast=True)
        QUARTER: tl.constexpr = BLOCK // 4
        quarter = tl.arange(0, QUARTER)
        round_stride = tl.cdiv(V, BLOCK) * BLOCK  # counters a round uses: one a token

        # pass 1: the row's largest logit m and round 0's race among every token: no candidate filter yet, so it needs no m (a token min_p
        # drops is rejected instead, as one outside the nucleus is)
        run_m = tl.full([QUARTER], -float("inf"), tl.float32)
        run_idx = tl.zeros([QUARTER], tl.int32)
        best_l = tl.full([QUARTER], _LOWEST, tl.float32)
        best_lq = tl.full([QUARTER], float("inf"), tl.float32)
        best_idx = tl.zeros([QUARTER], tl.int32)
        for v0 in range(0, V, BLOCK):
            for j in tl.static_range(4):
                offs = v0 + j * QUARTER + quarter
                u = _uniform(offs.to(tl.uint32), key_lo, key_hi)  # round 0's counters: the token ids
                run_m, run_idx, best_l, best_lq, best_idx = _first_pass(logits_row, offs, V, temperature, u, run_m,
                                                                        run_idx, best_l, best_lq, best_idx)
        m = tl.max(run_m, axis=0)
        likeliest = tl.sum(tl.where(quarter == tl.argmax(run_m, axis=0), run_idx, 0), axis=0)
        score = (best_l - m) / temperature - best_lq  # each lane's winner, now on one scale
        t = tl.sum(tl.where(quarter == tl.argmax(score, axis=0), best_idx, 0), axis=0)
        # the least x a token may have: min_p's bound and the k-th likeliest's x (-inf when unknown), computed
        # as `_tempered` computes every token's (a monotone map: the k-th largest x is the k-th largest l's)
        floor_x = tl.maximum(min_log, (kth - m) / temperature)

        chosen = s * 0  # int32 scalars
        done = s * 0
        r = s * 0
        while (done == 0) & (r < MAX_ROUNDS):
            x_t = _tempered(logits_row, t, t < V, m, temperature)
            mass = tl.zeros([QUARTER], tl.float32)  # what is likelier than t
            count = tl.zeros([QUARTER], tl.float32)
            kept = tl.zeros([QUARTER], tl.float32)  # the mass min_p and top-k keep (summed, not Z less the rest)
            for v0 in range(0, V, BLOCK):
                for j in tl.static_range(4):
                    x = _tempered(logits_row, v0 + j * QUARTER + quarter, v0 + j * QUARTER + quarter < V, m,
                                  temperature)
                    e = tl.exp(x)
                    above = (x >= floor_x) & (x > x_t)
                    mass += tl.where(above, e, 0.0)
                    count += tl.where(above, 1.0, 0.0)
                    kept += tl.where(x >= floor_x, e, 0.0)
            # the likeliest is always in (regression: a top_p that float32 rounds to 0 rejected it too, and
            # every row of the batch waited for 64 rounds and the fallback)
            in_p = (top_p >= 1.0) | (tl.sum(mass, axis=0) < top_p * tl.sum(kept, axis=0)) | (tl.sum(count, axis=0) == 0.0)
            in_k = (top_k <= 0.0) | (tl.sum(count, axis=0) < top_k)
            accepted = (x_t >= floor_x) & in_p & in_k
            chosen = tl.where(accepted, t, chosen)
            done = accepted.to(tl.int32)
            r += 1
            if done == 0:  # every token no likelier than t is out too: race again among the likelier ones
                best_score = tl.full([QUARTER], -float("inf"), tl.float32)
                best_idx = tl.zeros([QUARTER], tl.int32)
                for v0 in range(0, V, BLOCK):
                    for j in tl.static_range(4):
                        offs = v0 + j * QUARTER + quarter
                        x = _tempered(logits_row, offs, offs < V, m, temperature)
                        candidate = (x >= floor_x) & (x > x_t)
                        if tl.max(candidate.to(tl.int32), axis=0) > 0:  # (most quarters have none after a round)
                            u = _uniform((r * round_stride + offs).to(tl.uint32), key_lo, key_hi)
                            q = tl.maximum(-tl.log(1.0 - u), _SMALLEST)
                            score = tl.where(candidate, x - tl.log(q), -float("inf"))
                            better = score > best_score
                            best_score = tl.where(better, score, best_score)
                            best_idx = tl.where(better, offs, best_idx)
                t = tl.sum(tl.where(quarter == tl.argmax(best_score, axis=0), best_idx, 0), axis=0)
        chosen = tl.where(done == 0, likeliest, chosen)  # MAX_ROUNDS rejections: the likeliest (in every set)
        tl.store(out_ptr + s, chosen.to(tl.int64))


def pack_params(rows: list[int], temperatures: list[float], top_ps: list[float], min_logs: list[float],
                top_ks: list[int], seeds: list[int]) -> torch.Tensor:
    """The kernel's per-row inputs as one host tensor [8, S] int32 (one upload): temperature, top_p,
    log(min_p), top_k as float32 bits, the row, the seed's low and high 32 bits (seeds in [0, 2**64)), the
    k-th likeliest logit's bits as -inf (`set_kth_logits` fills it in on the device)."""
    floats = np.array([temperatures, top_ps, min_logs, top_ks], dtype=np.float32).view(np.int32)  # [4, S]
    halves = np.array(seeds, dtype=np.uint64).view(np.uint32).reshape(-1, 2).T.view(np.int32)  # [2, S]: low, high
    kth = np.full((1, len(rows)), -np.inf, dtype=np.float32).view(np.int32)  # [1, S]
    return torch.from_numpy(np.concatenate([floats, np.array([rows], dtype=np.int32), halves, kth]))


def set_kth_logits(logits: torch.Tensor, params: torch.Tensor, columns: list[int], ks: list[int]) -> None:
    """params[7, c] for each column c (a row with both top-k and top-p) := its row's ks[j]-th largest logit,
    NaN counted as float32's lowest and +-inf clamped (the kernel's `_clean`); queued on the device (no
    sync). One torch.topk of those rows: a partial selection of the largest k, not the sort of the row."""
    if not columns:
        return
    device, ks = params.device, [min(k, logits.shape[-1]) for k in ks]  # (k >= the vocabulary: the least, all kept)
    index = torch.tensor([columns, [k - 1 for k in ks]], dtype=torch.int64).to(device, non_blocking=True)  # [2, J]
    lowest = torch.finfo(torch.float32).min
    x = torch.nan_to_num(logits.index_select(0, params[4, index[0]].long()).float(), nan=lowest)  # [J, V]
    kth = torch.topk(x, max(ks), dim=-1, sorted=True).values.gather(1, index[1, :, None])[:, 0]  # [J]
    params[7].index_copy_(0, index[0], kth.view(torch.int32))


def sample_rows(logits: torch.Tensor, params: torch.Tensor, **config) -> torch.Tensor:
    """logits [B, V] (any float dtype, rows contiguous), params [8, S] int32 on the logits' device
    (`pack_params`; temperature > 0, top_p in (0, 1]; a row with top_k > 0 and top_p < 1 after
    `set_kth_logits`) -> token ids [S] int64. config overrides BLOCK / num_warps / num_stages (benchmarks)."""
    if logits.stride(-1) != 1:
        raise ValueError("logits rows must be contiguous")
    num_rows = params.shape[1]
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        block = max(16, min(BLOCK, triton.next_power_of_2(logits.shape[-1])))
        cfg = {"BLOCK": block, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES, **config}
        _sample_rows_kernel[(num_rows,)](logits, logits.stride(0), params, out, num_rows, logits.shape[-1],
                                         MAX_ROUNDS=MAX_ROUNDS, **cfg)
    return out

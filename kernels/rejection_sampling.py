"""Top-p / top-k / min_p sampling without a sort: rejection rounds, each row split over programs.

`scheduler/sampling.py` draws a batch's sampled rows as vLLM V1 does: temperature, min_p, top-k,
top-p, then one draw. Its torch path sorts the whole batch for top-k/top-p ([32, 151,936] on the
H200: most of the ~1 ms a sampled decode step costs over a greedy one). These kernels draw the same
distribution without sorting (the idea of FlashInfer's sampling kernels):

  1. pass 1: the row's largest logit m and round 0's draw t among all tokens by the exponential race
     (argmax of x - log q, q ~ Exp(1), x = (l - m) / T; kept per lane as (l, log q) pairs: no m needed);
  2. a pass for candidate t: t is kept iff min_p keeps it, fewer than k tokens are likelier (top-k) and
     their mass is below top_p times the mass min_p and top-k keep (top-p of the top-k set, as the sort
     renormalizes it; the likeliest always). The same pass races among the tokens likelier than t: if t
     is not kept, every token no likelier is out too (each set is closed upwards), and that race's
     winner is the next candidate, and so on.

A draw from a superset, kept only when it lands in the set, is a draw from the set: the result has
exactly the distribution of the sort-based path. Ties differ only in which of a tie at the edge of
the nucleus is kept: here all of it, there the sort's choice (vLLM's too). The likeliest token is
always accepted, so a round never lacks a candidate; each rejection removes about half of what is
left, so candidates are ~1 for a top_p near 1 and a few for small ones or a top_k. After MAX_ROUNDS
rejections (not met in practice) the likeliest token is taken.

The work: a row is cut into chunks of CHUNK tokens, a program each (one program streaming a whole
151,936-token row was bound by its loads' latency, ~0.1 ms a pass: session 36). `_first_kernel` runs
pass 1 per chunk; each of ROUNDS `_round_kernel` launches combines the row's chunks' results (each
program its row's, a few dozen numbers), decides the last candidate and runs the next candidate's pass
over its chunk; `_finish_kernel` decides the last and lets a row that needs more rounds (rare) go on in
one program. The chunks' count depends on the vocabulary only, so a row's sums (and draw) do not depend
on its batch. On the H200, queued behind a forward as in a decode step: 0.04 / 0.09 / 0.14 ms for 1 / 32
/ 64 top_p rows, against 0.18 / 0.98 / 1.57 ms for the sort (session 37).

A row with both top-k and top-p gets its k-th likeliest logit first (`set_kth_logits`: each chunk's k
largest by k rounds of max, then the k-th of those; torch.topk for a k above K_LIMIT), and every token
below it counts as min_p's rejects do (ties with it kept, as the sort keeps them): top-p of the top-k set
needs that set's mass before its first test. A row with top-k alone is tested by its count (cheaper than
finding the k-th logit). Randomness: a counter hash (`_uniform`) keyed
by a per-row 64-bit seed the caller draws from the row's generator, the counter round * V + token: a
seeded row's draw does not depend on its batch or its chunks. Runs on the CPU under TRITON_INTERPRET=1
in tests.
"""
from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    triton = None

from kernels.direct_launch import DirectLaunch

MAX_ROUNDS = 64
BLOCK = 2048  # tokens a program handles per step of its loop (fewer for a small vocabulary)
# (CHUNK, ROUNDS, NUM_WARPS: the fastest of scripts/probe_sample.py --sweep on the H200 for top_p rows at
# B = 8, 32, 64, session 37; 8 rounds suit top_k 50 rows better, 0.01 ms slower for top_p ones)
CHUNK = 4096  # tokens of a row a program takes (151,936: 38 programs a row)
ROUNDS = 4  # rounds decided by all of a row's programs; a row needing more goes on in one program
NUM_WARPS = 4
FINISH_WARPS = 16  # (one program streams a whole row: the fastest of the sweep on the H200, session 36)
NUM_STAGES = 1
# a k-th logit for a top_k up to this by the chunk kernels (k rounds of max each: ~0.075 ms for 32 rows at k 20,
# ~0.18 at k 50 on the H200), a larger one by torch.topk (~0.12 whatever k; session 37)
K_LIMIT = 32

if triton is not None:
    # (a jit function reads a module global only as a constexpr; the interpreter reads any: session 36)
    _LOWEST, _HIGHEST = tl.constexpr(-3.4028234663852886e38), tl.constexpr(3.4028234663852886e38)  # float32's range
    # the least Exp(1) draw: -log(1 - u) of the least nonzero uniform (2**-24); u = 0 (once in 2**24 tokens)
    # counts as that (regression: clamped at float32's smallest normal, its log, -87, let a token of any
    # probability win about one race in a hundred over 151,936 tokens; torch's exponential_ never goes below ~2**-25)
    _SMALLEST = tl.constexpr(5.960464477539063e-08)
    _MUL_1, _MUL_2 = tl.constexpr(0x7FEB352D), tl.constexpr(0x846CA68B)
    # ws[s, c, :] (float32, indices as their bits): chunk c of row s's pass 1 (its max, where, its race
    # winner's l, log q and token) at 0..4, then two slots (rounds alternate) of a round's pass at 5..9, 10..14
    WS_FIELDS = tl.constexpr(16)

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
        ~16 integer operations where Philox-4x32-10 costs ~50 a number (no faster on the H200 when one
        program streamed a whole row, session 36; kept as the simpler stream, checked against a Python
        reference on both devices)."""
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
    def _row_params(params_ptr, S, s):
        """Row s's parameters (`pack_params`): temperature, top_p, log(min_p), top_k, the logits row, the
        key's halves, the k-th likeliest logit."""
        temperature = tl.load(params_ptr + s).to(tl.float32, bitcast=True)
        top_p = tl.load(params_ptr + S + s).to(tl.float32, bitcast=True)
        min_log = tl.load(params_ptr + 2 * S + s).to(tl.float32, bitcast=True)
        top_k = tl.load(params_ptr + 3 * S + s).to(tl.float32, bitcast=True)
        row = tl.load(params_ptr + 4 * S + s).to(tl.int64)
        key_lo = tl.load(params_ptr + 5 * S + s).to(tl.uint32, bitcast=True)
        key_hi = tl.load(params_ptr + 6 * S + s).to(tl.uint32, bitcast=True)
        kth = tl.load(params_ptr + 7 * S + s).to(tl.float32, bitcast=True)
        return temperature, top_p, min_log, top_k, row, key_lo, key_hi, kth

    @triton.jit
    def _first_kernel(logits_ptr, row_stride, params_ptr, ws_ptr, state_ptr, S, V,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Program (s, c): pass 1 over chunk c of row s: its largest logit and where, and its winner of
        round 0's race among all its tokens -> ws[s, c, 0:5]. Program (s, 0) marks the row undecided."""
        s, c = tl.program_id(0), tl.program_id(1)
        temperature, top_p, min_log, top_k, row, key_lo, key_hi, kth = _row_params(params_ptr, S, s)
        logits_row = logits_ptr + row * row_stride
        QUARTER: tl.constexpr = BLOCK // 4
        quarter = tl.arange(0, QUARTER)
        run_m = tl.full([QUARTER], -float("inf"), tl.float32)
        run_idx = tl.zeros([QUARTER], tl.int32)
        best_l = tl.full([QUARTER], _LOWEST, tl.float32)
        best_lq = tl.full([QUARTER], float("inf"), tl.float32)
        best_idx = tl.zeros([QUARTER], tl.int32)
        hi = tl.minimum(V, (c + 1) * CHUNK)
        for v0 in range(c * CHUNK, hi, BLOCK):
            for j in tl.static_range(4):  # four independent quarter blocks: more loads in flight
                offs = v0 + j * QUARTER + quarter
                u = _uniform(offs.to(tl.uint32), key_lo, key_hi)  # round 0's counters: the token ids
                run_m, run_idx, best_l, best_lq, best_idx = _first_pass(logits_row, offs, hi, temperature, u, run_m,
                                                                        run_idx, best_l, best_lq, best_idx)
        m = tl.max(run_m, axis=0)
        lane = tl.argmax((best_l - m) / temperature - best_lq, axis=0)  # the chunk's winner, on one scale
        out = ws_ptr + (s * tl.num_programs(1) + c) * WS_FIELDS
        tl.store(out, m)
        tl.store(out + 1, tl.sum(tl.where(quarter == tl.argmax(run_m, axis=0), run_idx, 0), axis=0).to(tl.float32, bitcast=True))
        tl.store(out + 2, tl.sum(tl.where(quarter == lane, best_l, 0.0), axis=0))
        tl.store(out + 3, tl.sum(tl.where(quarter == lane, best_lq, 0.0), axis=0))
        tl.store(out + 4, tl.sum(tl.where(quarter == lane, best_idx, 0), axis=0).to(tl.float32, bitcast=True))
        if c == 0:
            tl.store(state_ptr + s * 4, 0)

    @triton.jit
    def _combine_first(ws_row, P, temperature, P_POW2: tl.constexpr):
        """The row's chunks' pass 1 combined: (largest logit m, the likeliest token, round 0's draw t)."""
        cs = tl.arange(0, P_POW2)
        ok = cs < P
        run_m = tl.load(ws_row + cs * WS_FIELDS, mask=ok, other=-float("inf"))
        run_idx = tl.load(ws_row + cs * WS_FIELDS + 1, mask=ok, other=0.0).to(tl.int32, bitcast=True)
        m = tl.max(run_m, axis=0)
        likeliest = tl.sum(tl.where(cs == tl.argmax(run_m, axis=0), run_idx, 0), axis=0)
        best_l = tl.load(ws_row + cs * WS_FIELDS + 2, mask=ok, other=_LOWEST)
        best_lq = tl.load(ws_row + cs * WS_FIELDS + 3, mask=ok, other=float("inf"))
        best_idx = tl.load(ws_row + cs * WS_FIELDS + 4, mask=ok, other=0.0).to(tl.int32, bitcast=True)
        score = tl.where(ok, (best_l - m) / temperature - best_lq, -float("inf"))
        return m, likeliest, tl.sum(tl.where(cs == tl.argmax(score, axis=0), best_idx, 0), axis=0)

    @triton.jit
    def _accept(x_t, floor_x, mass, count, kept, top_p, top_k):
        """Whether candidate t is the draw: min_p and top-k keep it (x_t >= floor_x), fewer than top_k tokens
        are likelier and their mass is below top_p times the kept mass (the likeliest always: regression,
        a top_p that float32 rounds to 0 rejected it too, and every row waited for the fallback)."""
        in_p = (top_p >= 1.0) | (mass < top_p * kept) | (count == 0.0)
        in_k = (top_k <= 0.0) | (count < top_k)
        return (x_t >= floor_x) & in_p & in_k

    @triton.jit
    def _combine_round(ws_row, P, slot, x_t, floor_x, top_p, top_k, P_POW2: tl.constexpr):
        """The row's chunks' pass for candidate t (ws fields at `slot`) combined: (t accepted, the next
        race's winner: the draw among the tokens likelier than t, when t is not)."""
        cs = tl.arange(0, P_POW2)
        ok = cs < P
        at = ws_row + cs * WS_FIELDS + slot
        mass = tl.sum(tl.load(at, mask=ok, other=0.0), axis=0)
        count = tl.sum(tl.load(at + 1, mask=ok, other=0.0), axis=0)
        kept = tl.sum(tl.load(at + 2, mask=ok, other=0.0), axis=0)
        score = tl.load(at + 3, mask=ok, other=-float("inf"))
        idx = tl.load(at + 4, mask=ok, other=0.0).to(tl.int32, bitcast=True)
        return (_accept(x_t, floor_x, mass, count, kept, top_p, top_k),
                tl.sum(tl.where(cs == tl.argmax(score, axis=0), idx, 0), axis=0))

    @triton.jit
    def _pass(logits_row, lo, hi, m, temperature, x_t, floor_x, counter_base, key_lo, key_hi, BLOCK: tl.constexpr):
        """One pass over tokens [lo, hi) for candidate t: the mass and count of the kept tokens likelier
        than t and the mass of all kept (for t's test), and the next race among those likelier tokens
        (uniforms at counter_base + token; the blocks without such a token skip it: most, after a round)
        -> (mass, count, kept, the race's best score, its token)."""
        QUARTER: tl.constexpr = BLOCK // 4
        quarter = tl.arange(0, QUARTER)
        mass = tl.zeros([QUARTER], tl.float32)
        count = tl.zeros([QUARTER], tl.float32)
        kept = tl.zeros([QUARTER], tl.float32)  # summed, not Z less the rest
        best_score = tl.full([QUARTER], -float("inf"), tl.float32)
        best_idx = tl.zeros([QUARTER], tl.int32)
        for v0 in range(lo, hi, BLOCK):
            for j in tl.static_range(4):
                offs = v0 + j * QUARTER + quarter
                ok = offs < hi
                x = _tempered(logits_row, offs, ok, m, temperature)
                e = tl.exp(x)
                inside = ok & (x >= floor_x)
                above = inside & (x > x_t)
                mass += tl.where(above, e, 0.0)
                count += tl.where(above, 1.0, 0.0)
                kept += tl.where(inside, e, 0.0)
                if tl.max(above.to(tl.int32), axis=0) > 0:
                    u = _uniform((counter_base + offs).to(tl.uint32), key_lo, key_hi)
                    score = tl.where(above, x - tl.log(tl.maximum(-tl.log(1.0 - u), _SMALLEST)), -float("inf"))
                    better = score > best_score
                    best_score = tl.where(better, score, best_score)
                    best_idx = tl.where(better, offs, best_idx)
        lane = tl.argmax(best_score, axis=0)
        return (tl.sum(mass, axis=0), tl.sum(count, axis=0), tl.sum(kept, axis=0),
                tl.max(best_score, axis=0), tl.sum(tl.where(quarter == lane, best_idx, 0), axis=0))

    @triton.jit
    def _row_start(logits_ptr, row_stride, params_ptr, ws_ptr, S, s, P, P_POW2: tl.constexpr):
        """What a round needs of row s after pass 1: its parameters, its logits and ws rows, the chunks'
        pass 1 combined (m, the likeliest, round 0's draw) and the least x a token may have: min_p's bound
        and the k-th likeliest's x (-inf when unknown), computed as `_tempered` computes every token's
        (monotone: the k-th largest x is the k-th largest l's)."""
        temperature, top_p, min_log, top_k, row, key_lo, key_hi, kth = _row_params(params_ptr, S, s)
        ws_row = ws_ptr + s * P * WS_FIELDS
        m, likeliest, t = _combine_first(ws_row, P, temperature, P_POW2)
        floor_x = tl.maximum(min_log, (kth - m) / temperature)
        return (temperature, top_p, top_k, key_lo, key_hi, logits_ptr + row * row_stride, ws_row, m, likeliest, t,
                floor_x)

    @triton.jit(do_not_specialize=["r"])
    def _round_kernel(logits_ptr, row_stride, params_ptr, ws_ptr, state_ptr, out_ptr, S, V, P, r,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr, P_POW2: tl.constexpr):
        """Program (s, c), round r: candidate t_{r-1} decided from the chunks' last pass (accepted: (s, 0)
        writes the draw and marks the row done), else t_r (round 0: pass 1's draw) and one pass over chunk c
        for it -> ws[s, c] at slot r % 2 (each program combines its row's chunks itself: P numbers)."""
        s, c = tl.program_id(0), tl.program_id(1)
        if tl.load(state_ptr + s * 4) == 0:
            (temperature, top_p, top_k, key_lo, key_hi, logits_row, ws_row, m, likeliest, t,
             floor_x) = _row_start(logits_ptr, row_stride, params_ptr, ws_ptr, S, s, P, P_POW2)
            accepted = r < 0
            if r > 0:
                last = tl.load(state_ptr + s * 4 + 1 + (r - 1) % 2)
                accepted, t = _combine_round(ws_row, P, 5 + 5 * ((r - 1) % 2),
                                             _tempered(logits_row, last, last < V, m, temperature), floor_x,
                                             top_p, top_k, P_POW2)
                if accepted & (c == 0):
                    tl.store(out_ptr + s, last.to(tl.int64))
                    tl.store(state_ptr + s * 4, 1)
            if accepted == 0:
                if c == 0:
                    tl.store(state_ptr + s * 4 + 1 + r % 2, t)
                mass, count, kept, score, idx = _pass(logits_row, c * CHUNK, tl.minimum(V, (c + 1) * CHUNK), m,
                                                      temperature, _tempered(logits_row, t, t < V, m, temperature),
                                                      floor_x, (r + 1) * V, key_lo, key_hi, BLOCK)
                at = ws_row + c * WS_FIELDS + 5 + 5 * (r % 2)
                tl.store(at, mass)
                tl.store(at + 1, count)
                tl.store(at + 2, kept)
                tl.store(at + 3, score)
                tl.store(at + 4, idx.to(tl.float32, bitcast=True))

    @triton.jit
    def _finish_kernel(logits_ptr, row_stride, params_ptr, ws_ptr, state_ptr, out_ptr, S, V, P, R,
                       BLOCK: tl.constexpr, P_POW2: tl.constexpr, MAX_ROUNDS: tl.constexpr):
        """Program s, after R rounds: candidate t_{R-1} decided; a row still undecided (rare) goes on alone
        over its whole row a round a pass; after MAX_ROUNDS rejections in all, the likeliest token."""
        s = tl.program_id(0)
        if tl.load(state_ptr + s * 4) == 0:
            (temperature, top_p, top_k, key_lo, key_hi, logits_row, ws_row, m, likeliest, t,
             floor_x) = _row_start(logits_ptr, row_stride, params_ptr, ws_ptr, S, s, P, P_POW2)
            chosen = tl.load(state_ptr + s * 4 + 1 + (R - 1) % 2)
            accepted, t = _combine_round(ws_row, P, 5 + 5 * ((R - 1) % 2),
                                         _tempered(logits_row, chosen, chosen < V, m, temperature), floor_x,
                                         top_p, top_k, P_POW2)
            r = R
            while (accepted == 0) & (r < MAX_ROUNDS):
                x_t = _tempered(logits_row, t, t < V, m, temperature)
                mass, count, kept, score, idx = _pass(logits_row, 0, V, m, temperature, x_t, floor_x,
                                                      (r + 1) * V, key_lo, key_hi, BLOCK)
                accepted = _accept(x_t, floor_x, mass, count, kept, top_p, top_k)
                chosen = t
                t = idx
                r += 1
            tl.store(out_ptr + s, tl.where(accepted, chosen, likeliest).to(tl.int64))

    @triton.jit
    def _largest(x, k, K_POW2: tl.constexpr):
        """The k largest of x (1-D, k <= K_POW2), largest first, each taken out once (ties as often as they
        occur): k rounds of max and argmax -> [K_POW2] (-inf past k)."""
        slots = tl.arange(0, K_POW2)
        at = tl.arange(0, x.shape[0])
        largest = tl.full([K_POW2], -float("inf"), tl.float32)
        for i in range(0, k):
            largest = tl.where(slots == i, tl.max(x, axis=0), largest)
            x = tl.where(at == tl.argmax(x, axis=0), -float("inf"), x)
        return largest

    @triton.jit
    def _chunk_top_kernel(logits_ptr, row_stride, params_ptr, cols_ptr, top_ptr, S, V, CHUNK: tl.constexpr,
                          K_POW2: tl.constexpr):
        """Program (j, c): the k largest logits of chunk c of row s = cols[j] (k: its top_k, at most K_POW2;
        `_clean`'s values) -> top[j, c, :] (-inf past k)."""
        j, c = tl.program_id(0), tl.program_id(1)
        s = tl.load(cols_ptr + j)
        k = tl.load(params_ptr + 3 * S + s).to(tl.float32, bitcast=True).to(tl.int32)
        logits_row = logits_ptr + tl.load(params_ptr + 4 * S + s).to(tl.int64) * row_stride
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ok = offs < V
        x = tl.where(ok, _clean(logits_row, offs, ok), -float("inf"))
        tl.store(top_ptr + (j * tl.num_programs(1) + c) * K_POW2 + tl.arange(0, K_POW2), _largest(x, k, K_POW2))

    @triton.jit
    def _kth_kernel(params_ptr, cols_ptr, top_ptr, S, P, K_POW2: tl.constexpr, P_POW2: tl.constexpr):
        """Program j: the k-th largest logit of row s = cols[j] from its chunks' k largest (the row's k
        largest are among them) -> params[7, s] as float32 bits."""
        j = tl.program_id(0)
        s = tl.load(cols_ptr + j)
        k = tl.load(params_ptr + 3 * S + s).to(tl.float32, bitcast=True).to(tl.int32)
        at = tl.arange(0, P_POW2 * K_POW2)
        x = tl.load(top_ptr + j * P * K_POW2 + at, mask=at < P * K_POW2, other=-float("inf"))
        kth = tl.sum(tl.where(tl.arange(0, K_POW2) == k - 1, _largest(x, k, K_POW2), 0.0), axis=0)
        tl.store(params_ptr + 7 * S + s, kth.to(tl.int32, bitcast=True))


def pack_params(rows: list[int], temperatures: list[float], top_ps: list[float], min_logs: list[float],
                top_ks: list[int], seeds: list[int]) -> torch.Tensor:
    """The kernel's per-row inputs as one host tensor [8, S] int32 (one upload): temperature, top_p,
    log(min_p), top_k as float32 bits, the row, the seed's low and high 32 bits (seeds in [0, 2**64)), the
    k-th likeliest logit's bits as -inf (`set_kth_logits` fills it in on the device)."""
    floats = np.array([temperatures, top_ps, min_logs, top_ks], dtype=np.float32).view(np.int32)  # [4, S]
    halves = np.array(seeds, dtype=np.uint64).view(np.uint32).reshape(-1, 2).T.view(np.int32)  # [2, S]: low, high
    kth = np.full((1, len(rows)), -np.inf, dtype=np.float32).view(np.int32)  # [1, S]
    return torch.from_numpy(np.concatenate([floats, np.array([rows], dtype=np.int32), halves, kth]))


def set_kth_logits(logits: torch.Tensor, params: torch.Tensor, columns: list[int], ks: list[int],
                   **config) -> None:
    """params[7, c] for each column c (a row with top_k k = ks[j] in params) := its row's k-th largest
    logit, NaN counted as float32's lowest and +-inf clamped (the kernels' `_clean`); queued on the device
    (no sync). k <= K_LIMIT: `_chunk_top_kernel` (each chunk's k largest) and `_kth_kernel` (the k-th of
    those); a larger k: torch.topk of those rows. config: CHUNK (tests)."""
    vocab = logits.shape[-1]  # (k beyond the row: none, -inf, every token kept)
    small = [(c, k) for c, k in zip(columns, ks) if 0 < k <= min(K_LIMIT, vocab)]
    large = [(c, k) for c, k in zip(columns, ks) if K_LIMIT < k <= vocab]
    num_rows = params.shape[1]
    if small:
        k_pow2 = max(2, triton.next_power_of_2(max(k for _, k in small)))
        chunk = config.get("CHUNK", CHUNK)
        chunks = triton.cdiv(vocab, chunk)
        # only these columns (regression: the kernels took every row with a top_k in params, so a top-k-only
        # row beside a row with both got a k-th logit, and its draw depended on its batch)
        cols = torch.tensor([c for c, _ in small], dtype=torch.int32).to(logits.device, non_blocking=True)  # [J]
        top = torch.empty((len(small), chunks, k_pow2), dtype=torch.float32, device=logits.device)
        _launch(_chunk_top_kernel, (len(small), chunks), (logits, logits.stride(0), params, cols, top, num_rows, vocab),
                CHUNK=chunk, K_POW2=k_pow2, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
        _launch(_kth_kernel, (len(small),), (params, cols, top, num_rows, chunks), K_POW2=k_pow2,
                P_POW2=max(2, triton.next_power_of_2(chunks)), num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if large:
        device, lowest = params.device, torch.finfo(torch.float32).min
        index = torch.tensor([[c for c, _ in large], [k - 1 for _, k in large]],
                             dtype=torch.int64).to(device, non_blocking=True)  # [2, J]
        x = torch.nan_to_num(logits.index_select(0, params[4, index[0]].long()).float(), nan=lowest)  # [J, V]
        kth = torch.topk(x, max(k for _, k in large), dim=-1, sorted=True).values.gather(1, index[1, :, None])[:, 0]
        params[7].index_copy_(0, index[0], kth.view(torch.int32))


def sample_rows(logits: torch.Tensor, params: torch.Tensor, **config) -> torch.Tensor:
    """logits [B, V] (any float dtype, rows contiguous), params [8, S] int32 on the logits' device
    (`pack_params`; temperature > 0, top_p in (0, 1]; a row with top_k > 0 and top_p < 1 after
    `set_kth_logits`) -> token ids [S] int64: `_first_kernel`, ROUNDS `_round_kernel`s, `_finish_kernel`,
    each row in chunks of CHUNK tokens a program. config overrides BLOCK, CHUNK, ROUNDS, MAX_ROUNDS,
    num_warps, finish_warps, num_stages (tests, benchmarks)."""
    if logits.stride(-1) != 1:
        raise ValueError("logits rows must be contiguous")
    num_rows, vocab = params.shape[1], logits.shape[-1]
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if not num_rows:
        return out
    block = config.get("BLOCK", max(16, min(BLOCK, triton.next_power_of_2(vocab))))
    chunk = config.get("CHUNK", max(block, CHUNK))  # (a multiple of the block: the chunks' loops stay aligned)
    max_rounds = config.get("MAX_ROUNDS", MAX_ROUNDS)
    rounds = max(1, min(config.get("ROUNDS", ROUNDS), max_rounds))
    chunks = triton.cdiv(vocab, chunk)  # (of the vocabulary only: a row's sums do not depend on its batch)
    ws = torch.empty((num_rows, chunks, WS_FIELDS.value), dtype=torch.float32, device=logits.device)
    state = torch.empty((num_rows, 4), dtype=torch.int32, device=logits.device)  # done, a candidate a slot
    meta = {"num_warps": config.get("num_warps", NUM_WARPS), "num_stages": config.get("num_stages", NUM_STAGES)}
    common = (logits, logits.stride(0), params, ws, state)
    p_pow2 = max(2, triton.next_power_of_2(chunks))
    _launch(_first_kernel, (num_rows, chunks), (*common, num_rows, vocab), CHUNK=chunk, BLOCK=block, **meta)
    for r in range(rounds):
        _launch(_round_kernel, (num_rows, chunks), (*common, out, num_rows, vocab, chunks, r), CHUNK=chunk,
                BLOCK=block, P_POW2=p_pow2, **meta)
    _launch(_finish_kernel, (num_rows,), (*common, out, num_rows, vocab, chunks, rounds), BLOCK=block,
            P_POW2=p_pow2, MAX_ROUNDS=max_rounds, num_warps=config.get("finish_warps", FINISH_WARPS),
            num_stages=meta["num_stages"])
    return out


_DIRECT: dict = {}  # kernel -> DirectLaunch (CUDA)


def _launch(kernel, grid: tuple, args: tuple, **meta) -> None:
    """kernel[grid](*args, **meta), on CUDA without the JIT's per-call dispatch (kernels/direct_launch.py;
    ROUNDS + 2 launches a draw, ~30 µs of host time each on the H200's host)."""
    if args[0].device.type != "cuda":
        kernel[grid](*args, **meta)
        return
    if kernel not in _DIRECT:
        _DIRECT[kernel] = DirectLaunch(kernel)
    _DIRECT[kernel](grid, torch.cuda.current_stream(args[0].device), *args, **meta)

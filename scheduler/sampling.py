"""Next-token sampling: greedy, or temperature, min_p, top-k and top-p with a per-request seeded generator,
the sampled rows of a batch drawn together."""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from scheduler.request import TokenLogprobs

_MASK_32, _MASK_64 = (1 << 32) - 1, (1 << 64) - 1


def _mix_32(x: int) -> int:
    """murmur3's 32-bit finaliser: a bijection of [0, 2**32) that keeps 0 at 0."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK_32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK_32
    return x ^ (x >> 16)


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A request's generator for `seed` (any 64-bit integer, signed or not: its two's-complement bits).
    CUDA's Philox takes all 64 bits; the CPU's mt19937 only the low 32, so seeds that differed only
    above them (7, 7 + 2**32, 7 + 2**63) drew the same tokens: a CPU seed's high half is mixed into
    its low half first (a seed below 2**32 keeps its stream; two others collide about once in 2**32)."""
    seed = int(seed) & _MASK_64  # (numpy ints too)
    if torch.device(device).type == "cpu":
        seed = (seed & _MASK_32) ^ _mix_32(seed >> 32)
    return torch.Generator(device=device).manual_seed(seed)


NAN_TOKEN = -1  # a row whose chosen token's logit is NaN (`mark_nan`): its request fails


def mark_nan(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """next_ids [B] with NAN_TOKEN where the chosen token's logit is NaN: a greedy row with any NaN
    (argmax takes a NaN), or a sampled row of nothing but NaN (drawn uniformly); a sampled row's
    other NaNs have no probability. Regression: such a request was streamed those tokens, with no
    error. A gather of B logits, not a pass over the vocabulary."""
    chosen = logits.gather(-1, next_ids[:, None])[:, 0]  # [B]
    return torch.where(torch.isnan(chosen), NAN_TOKEN, next_ids)


def sample(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           generators: list[torch.Generator | None], top_ks: Sequence[int] = (),
           min_ps: Sequence[float] = ()) -> torch.Tensor:
    """logits: [B, vocab] -> token ids [B] (int64, same device). Greedy rows (temperature 0) stay on
    argmax; the sampled rows are drawn together, as vLLM V1 draws them: temperature, then min_p, then
    top-k, then top-p, then one draw per row by the exponential race (the argmax of probs / q, q ~ Exp(1)
    per token: a draw from probs), a seeded row's q from its own generator, the others' from the default
    one. A batch of sampled rows costs the same few kernels as one row (it was ~15 torch calls a row).
    On CUDA the rows with top-k or top-p are drawn without the sort by kernels/rejection_sampling.py
    (`_kernel_rows`): the same distribution, a key a row made on the host.

    top_ks / min_ps: per row (empty: off for every row). top_k k > 0 keeps the tokens at least as likely as
    the k-th likeliest (ties kept, as vLLM); 0 or -1, or k >= vocab: all. min_p keeps the tokens at least
    min_p times as likely as the likeliest (0: all).

    Any temperature in (0, 100] and top_p in (0, 1] gives a valid distribution: the logits are
    shifted so their largest is 0 before the division (a tiny temperature sends the others to -inf
    instead of the largest to +inf), a temperature is at least float32's smallest normal value (one
    that float32 rounds to 0 made the largest 0 / 0, NaN), and top-p always keeps the likeliest token
    (a top_p below float32's smallest value would otherwise keep none)."""
    next_ids = torch.argmax(logits, dim=-1)  # [B]
    rows = [i for i, t in enumerate(temperatures) if t > 0.0]
    if not rows:
        return next_ids
    vocab, device = logits.shape[-1], logits.device
    lowest, smallest = torch.finfo(torch.float32).min, torch.finfo(torch.float32).tiny
    ks = [top_ks[i] if top_ks and 0 < top_ks[i] < vocab else 0 for i in rows]
    ps = [top_ps[i] for i in rows]
    min_logs = [math.log(min_ps[i]) if min_ps and min_ps[i] > 0.0 else -math.inf for i in rows]
    by_kernel = _kernel_rows(logits, ks, ps)  # (positions in rows)
    if by_kernel:
        next_ids = _sample_by_kernel(logits, next_ids, [rows[j] for j in by_kernel], temperatures,
                                     [ps[j] for j in by_kernel], [min_logs[j] for j in by_kernel],
                                     [ks[j] for j in by_kernel], generators)
        rest = sorted(set(range(len(rows))) - set(by_kernel))
        if not rest:
            return next_ids
        rows, ks, ps, min_logs = ([v[j] for j in rest] for v in (rows, ks, ps, min_logs))
    # one upload: per sampled row its temperature, top_p, log(min_p) and top-k's index in the sorted
    # row (the last for "all": its value is the row's least, so nothing falls below it)
    params = torch.tensor([[max(temperatures[i], smallest) for i in rows], ps, min_logs,
                           [k - 1 if k else vocab - 1 for k in ks]], dtype=torch.float32)
    params = params.to(device, non_blocking=True)  # [4, S]
    temps, p_dev, min_log, k_index = params[0, :, None], params[1, :, None], params[2, :, None], params[3, :, None]
    whole = rows == list(range(len(next_ids)))
    index = None if whole else torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)  # [S]
    x = logits if whole else logits.index_select(0, index)
    x = torch.nan_to_num(x.float(), nan=lowest)  # [S, V], finite
    x = (x - x.amax(dim=-1, keepdim=True)) / temps  # the likeliest at 0
    neg_inf = x.new_full((), -math.inf)
    if any(m > -math.inf for m in min_logs):  # p < min_p * p_max  <=>  x < log(min_p) (x's max is 0)
        x = torch.where(x < min_log, neg_inf, x)
    top_k, nucleus = any(ks), any(p < 1.0 for p in ps)
    if top_k or nucleus:
        x = _top_k_top_p(x, k_index.long(), p_dev, top_k, nucleus, neg_inf)
    q = torch.empty_like(x)  # [S, V]
    if any(generators[i] is None for i in rows):  # the unseeded rows' draws, in one call
        q.exponential_()
    for j, i in enumerate(rows):
        gen = generators[i]
        if gen is None:
            continue
        # a CPU generator draws on the CPU; any other is on the logits' kind of device (regression:
        # comparing devices, a generator made for "cuda" is not on "cuda:0", and its CPU draw raised
        # inside the loop, failing every request of the engine)
        if gen.device.type == "cpu" and device.type != "cpu":
            q[j].copy_(torch.empty(vocab).exponential_(generator=gen), non_blocking=True)
        else:
            q[j].exponential_(generator=gen)
    # argmax of exp(x) / q, as x - log q (a masked token stays at -inf; q is never 0: no +inf)
    choice = (x - q.clamp_min_(smallest).log_()).argmax(dim=-1)  # [S]
    return choice if whole else next_ids.index_copy_(0, index, choice)


# Rows with top-k or top-p drawn by kernels/rejection_sampling.py (no sort) on CUDA: None (the default;
# HICACHE_SAMPLING_KERNEL=0 in the environment: False); True: on any device (tests, on the CPU under
# TRITON_INTERPRET=1); False: always the torch path below.
USE_KERNEL: bool | None = False if os.environ.get("HICACHE_SAMPLING_KERNEL") == "0" else None


def _kernel_rows(logits: torch.Tensor, ks: list[int], ps: list[float]) -> list[int]:
    """Which sampled rows (positions in `sample`'s rows) the kernel draws: those with top-k or top-p (a
    row with neither needs no sort). Decided row by row, on the row's own parameters: a seeded row takes
    one path whatever shares its batch (regression: the batch went one way or the other as a whole, by
    whether a row had both, so a seeded row's draw depended on its batch)."""
    if USE_KERNEL is False or (USE_KERNEL is None and logits.device.type != "cuda") or logits.stride(-1) != 1:
        return []
    return [j for j, (k, p) in enumerate(zip(ks, ps)) if k > 0 or p < 1.0]


def _sample_by_kernel(logits: torch.Tensor, next_ids: torch.Tensor, rows: list[int], temperatures: list[float],
                      ps: list[float], min_logs: list[float], ks: list[int],
                      generators: list[torch.Generator | None]) -> torch.Tensor:
    """`sample`'s sampled rows drawn by the rejection kernel: every row's parameters and 64-bit key
    made on the host (a seeded row's from its own generator, `_step_seed`: its draw whatever its batch)
    and uploaded at once, the k-th likeliest logit of the rows with both top-k and top-p found on the device."""
    from kernels.rejection_sampling import pack_params, sample_rows, set_kth_logits

    smallest, device = torch.finfo(torch.float32).tiny, logits.device
    unseeded = sum(generators[i] is None for i in rows)
    unseeded = iter(torch.randint(0, 2**62, (unseeded,)).tolist() if unseeded else ())  # (torch's default CPU generator)
    seeds = [next(unseeded) if generators[i] is None else _step_seed(generators[i]) for i in rows]
    params = pack_params(rows, [max(temperatures[i], smallest) for i in rows], ps, min_logs, ks, seeds)
    params = params.to(device, non_blocking=True)  # [8, S]
    # top-p of the top-k set needs that set's mass (a top-k row alone is faster by its count: session 37)
    joint = [j for j, (k, p) in enumerate(zip(ks, ps)) if k > 0 and p < 1.0]
    set_kth_logits(logits, params, joint, [ks[j] for j in joint])
    choice = sample_rows(logits, params)  # [S]
    return choice if len(rows) == len(next_ids) else next_ids.index_copy_(0, params[4].long(), choice)


def _step_seed(gen: torch.Generator) -> int:
    """A seeded row's kernel key for this draw, on the host: a CPU generator draws it; a CUDA one's is
    its seed mixed with its Philox offset, which then moves on (as one of its own draws would), so the
    request's n-th token always gets the same seed and no kernel is launched for it."""
    if gen.device.type == "cpu":
        return int(torch.randint(0, 2**62, (1,), generator=gen))
    offset = gen.get_offset()
    gen.set_offset(offset + 4)
    x = (gen.initial_seed() ^ (offset * 0x9E3779B97F4A7C15)) & _MASK_64  # splitmix64 of (seed, offset)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)


def _top_k_top_p(x: torch.Tensor, k_index: torch.Tensor, top_p: torch.Tensor, top_k: bool, nucleus: bool,
                 neg_inf: torch.Tensor) -> torch.Tensor:
    """x [S, V] (tempered logits) with the tokens outside each row's top-k, then outside its top-p
    nucleus, at -inf: one sort of the batch. k_index [S, 1]: the k-th likeliest's place in the sorted
    row; top_p [S, 1]: a token stays while the mass of the likelier ones is below it (the likeliest
    always; 1: every token)."""
    ordered, order = x.sort(dim=-1, descending=True)  # [S, V]
    if top_k:  # ties with the k-th kept
        ordered = torch.where(ordered < ordered.gather(1, k_index), neg_inf, ordered)
    if nucleus:
        probs = ordered.softmax(dim=-1)
        # a top_p of 1 keeps all (regression: beside a top_p < 1 row, float32's running sum reached 1.0
        # before a row's least likely tokens and dropped them, so a seeded row's draw depended on its batch)
        keep = (probs.cumsum(dim=-1) - probs < top_p) | (top_p >= 1.0)
        keep[:, 0] = True
        ordered = torch.where(keep, ordered, neg_inf)
    return torch.empty_like(x).scatter_(1, order, ordered)


def token_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of a batch's rows, on the logits' device: (values [B, 1 + k] float32: the sampled token's,
    then the k likeliest tokens' in descending order; their ids [B, k] int64). log_softmax of the raw
    logits, before temperature and top-p (vLLM's default), so greedy and sampled rows read alike.
    A NaN logit counts as -inf (no probability, as `sample` draws it): a sampled row with a few keeps
    finite logprobs; a row whose sampled token's logit is NaN fails anyway (`mark_nan`)."""
    return _chosen_and_top(_log_softmax(logits), next_ids, k)


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(torch.nan_to_num(logits.float(), nan=float("-inf")), dim=-1)  # [B, V]


def _chosen_and_top(logprobs: torch.Tensor, next_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = logprobs.gather(-1, next_ids[:, None])  # [B, 1]
    if k == 0:
        return chosen, next_ids.new_empty((len(next_ids), 0))
    top_values, top_ids = torch.topk(logprobs, k, dim=-1)  # [B, k], sorted
    return torch.cat([chosen, top_values], dim=1), top_ids


PROMPT_LOGITS_SLICE_BYTES = 128 << 20  # float32 logits of one slice of prompt rows (`prompt_row_logprobs`)


def prompt_row_logprobs(logits_of, vocab_size: int, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                        k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_logprobs` of prompt rows, each for the prompt token after it: hidden [T, H] (the final norm's
    output of every row), rows [R] of them, targets [R] -> (values [R, 1 + k], ids [R, k], ranks [R] int64:
    vLLM's rank of each target). Their logits (`logits_of`: [n, H] -> [n, V] float32) are made a
    slice of rows at a time, within PROMPT_LOGITS_SLICE_BYTES: a long chunk's rows x vocab never exist at once."""
    step = max(1, PROMPT_LOGITS_SLICE_BYTES // (4 * vocab_size))
    parts = []
    for i in range(0, len(rows), step):
        logprobs = _log_softmax(logits_of(hidden.index_select(0, rows[i:i + step])))  # [n, V]
        values, ids = _chosen_and_top(logprobs, targets[i:i + step], k)
        # vLLM's rank of each target (its batched_count_greater_than): the tokens whose logprob is at least the
        # target's, itself included (1: the likeliest; a tie counts as ahead)
        parts.append((values, ids, (logprobs >= values[:, :1]).sum(dim=-1)))  # [n]
    return tuple(torch.cat(col) for col in zip(*parts))


def unpack_logprobs(values: torch.Tensor, ids: torch.Tensor, wants: list[int | None]) -> list:
    """`token_logprobs`' output on the host -> per row, None where its request did not ask, else
    TokenLogprobs with the k it asked for (the batch computed the largest k of its rows)."""
    vals, tops = values.tolist(), ids.tolist()
    return [None if k is None else TokenLogprobs(v[0], list(zip(t[:k], v[1:k + 1])))
            for k, v, t in zip(wants, vals, tops)]

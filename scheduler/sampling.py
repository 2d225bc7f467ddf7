"""Next-token sampling: greedy, or temperature + top-p with a per-request seeded generator."""
from __future__ import annotations

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
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, vocab] -> token ids [B] (int64, same device). Greedy rows stay on argmax.

    Any temperature in (0, 100] and top_p in (0, 1] gives a valid distribution: the logits are
    shifted so their largest is 0 before the division (a tiny temperature sends the others to -inf
    instead of the largest to +inf), a temperature is at least float32's smallest normal value (one
    that float32 rounds to 0 made the largest 0 / 0, NaN), and top-p always keeps the likeliest token
    (a top_p below float32's smallest value would otherwise keep none)."""
    next_ids = torch.argmax(logits, dim=-1)  # [B]
    sampled_rows = [i for i, t in enumerate(temperatures) if t > 0.0]
    lowest, smallest = torch.finfo(torch.float32).min, torch.finfo(torch.float32).tiny
    for i in sampled_rows:  # sampled rows are rare in benchmarks; keep them exact and simple
        row = torch.nan_to_num(logits[i].float(), nan=lowest)  # [vocab], finite
        probs = torch.softmax((row - row.max()) / max(temperatures[i], smallest), dim=-1)  # [vocab]
        if top_ps[i] < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_ps[i]
            keep[0] = True
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        gen = generators[i]
        # a CPU generator samples on the CPU; any other is on the logits' kind of device (regression:
        # comparing devices, a generator made for "cuda" is not on "cuda:0", and its CPU sample raised
        # inside the loop, failing every request of the engine)
        if gen is not None and gen.device.type == "cpu" and probs.device.type != "cpu":
            choice = torch.multinomial(probs.cpu(), 1, generator=gen).to(probs.device)
        else:
            choice = torch.multinomial(probs, 1, generator=gen)
        next_ids[i] = choice[0]
    return next_ids


def token_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of a batch's rows, on the logits' device: (values [B, 1 + k] float32: the sampled token's,
    then the k likeliest tokens' in descending order; their ids [B, k] int64). log_softmax of the raw
    logits, before temperature and top-p (vLLM's default), so greedy and sampled rows read alike.
    A NaN logit counts as -inf (no probability, as `sample` draws it): a sampled row with a few keeps
    finite logprobs; a row whose sampled token's logit is NaN fails anyway (`mark_nan`)."""
    logprobs = torch.log_softmax(torch.nan_to_num(logits.float(), nan=float("-inf")), dim=-1)  # [B, V]
    chosen = logprobs.gather(-1, next_ids[:, None])  # [B, 1]
    if k == 0:
        return chosen, next_ids.new_empty((len(next_ids), 0))
    top_values, top_ids = torch.topk(logprobs, k, dim=-1)  # [B, k], sorted
    return torch.cat([chosen, top_values], dim=1), top_ids


def unpack_logprobs(values: torch.Tensor, ids: torch.Tensor, wants: list[int | None]) -> list:
    """`token_logprobs`' output on the host -> per row, None where its request did not ask, else
    TokenLogprobs with the k it asked for (the batch computed the largest k of its rows)."""
    vals, tops = values.tolist(), ids.tolist()
    return [None if k is None else TokenLogprobs(v[0], list(zip(t[:k], v[1:k + 1])))
            for k, v, t in zip(wants, vals, tops)]

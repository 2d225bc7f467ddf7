"""Next-token sampling: greedy, or temperature + top-p with a per-request seeded generator."""
from __future__ import annotations

import torch


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

"""Next-token sampling: greedy, or temperature + top-p with a per-request seeded generator."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, vocab] -> token ids [B] (int64, same device). Greedy rows stay on argmax."""
    next_ids = torch.argmax(logits, dim=-1)  # [B]
    sampled_rows = [i for i, t in enumerate(temperatures) if t > 0.0]
    for i in sampled_rows:  # sampled rows are rare in benchmarks; keep them exact and simple
        probs = torch.softmax(logits[i].float() / temperatures[i], dim=-1)  # [vocab]
        if top_ps[i] < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_ps[i]
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        gen = generators[i]
        if gen is not None and gen.device != probs.device:
            choice = torch.multinomial(probs.cpu(), 1, generator=gen).to(probs.device)
        else:
            choice = torch.multinomial(probs, 1, generator=gen)
        next_ids[i] = choice[0]
    return next_ids

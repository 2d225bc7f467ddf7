"""vLLM V1's sampling distribution of one row in float64: the reference of tests/test_top_k_min_p.py and
tests/test_gpu_sampling.py (which must not import the HTTP server's modules)."""
from __future__ import annotations

import torch

VOCAB = 12


def reference_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                    min_p: float = 0.0) -> torch.Tensor:
    """vLLM V1's sampling distribution of one row, in float64: softmax(logits / temperature); tokens less
    likely than min_p * the likeliest dropped; then all but the k likeliest (ties with the k-th kept);
    then, renormalised, all but the nucleus (a token stays while the likelier ones' mass is below top_p)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    p = torch.where(p < min_p * p.max(), 0.0, p)
    if 0 < top_k < len(p):
        p = torch.where(p < torch.sort(p, descending=True).values[top_k - 1], 0.0, p)
    p = p / p.sum()
    ordered, order = torch.sort(p, descending=True)
    keep = torch.cumsum(ordered, 0) - ordered < top_p
    keep[0] = True
    p = torch.zeros_like(p).scatter_(0, order, torch.where(keep, ordered, 0.0))
    return p / p.sum()

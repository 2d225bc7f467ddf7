"""Session 38's hunt of the sampled path (scheduler/sampling.py `sample`, kernels/rejection_sampling.py)
over a vocabulary of two chunks, the second a single token (4,097: the kernels' default CHUNK is 4,096),
under TRITON_INTERPRET=1: a seeded row's token beside every kind of neighbour and at every position, and
the kernel and the sort drawing the same support for every setting (ties at the k-th across the chunks'
edge, a top_k above K_LIMIT with top_p, min_p with both)."""
from __future__ import annotations

import math

import pytest
import torch

from scheduler import sampling
from scheduler.sampling import sample, seeded_generator

CPU = torch.device("cpu")
VOCAB = 4097  # (one chunk of 4,096 and one of a token)


@pytest.fixture
def kernel_on(monkeypatch):
    monkeypatch.setattr(sampling, "USE_KERNEL", True)


def _sample(logits: torch.Tensor, rows: list[tuple]) -> torch.Tensor:
    """rows: (temperature, top_p, top_k, min_p, seed or None) a row, each seeded row a fresh generator."""
    return sample(logits, [r[0] for r in rows], [r[1] for r in rows],
                  [None if r[4] is None else seeded_generator(r[4], CPU) for r in rows],
                  [r[2] for r in rows], [r[3] for r in rows])


def _row(seed: int) -> torch.Tensor:
    """[VOCAB]: randn * 2 with its mass near the chunks' edge (tokens 4,095 and 4,096 the likeliest, tied)."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    row[4095] = row[4096] = row.max() + 0.5
    row[0] = row.max() - 0.2
    return row


NEIGHBOURS = [(0.0, 1.0, 0, 0.0, None),  # greedy
              (1.0, 1.0, 7, 0.0, 3),  # top_k only
              (0.7, 0.8, 0, 0.0, None),  # top_p only, unseeded
              (1.2, 0.9, 5, 0.0, 4),  # both, k <= K_LIMIT
              (1.0, 0.9, 60, 0.0, 5),  # both, k > K_LIMIT (torch.topk)
              (1.0, 1.0, 0, 0.1, 6),  # min_p only (the torch path)
              (1e-5, 1e-9, 0, 0.0, 7),  # tiny temperature and top_p
              (100.0, 1.0, 0, 0.0, None)]  # temperature only, unseeded


@pytest.mark.parametrize("target", [(0.9, 0.95, 0, 0.0, 2**63 + 11), (1.1, 0.9, 20, 0.05, 12),
                                    (1.0, 0.97, 40, 0.0, 13)])
def test_a_seeded_row_draws_the_same_beside_any_neighbour_and_at_any_position(kernel_on, target):
    torch.manual_seed(0)
    batch = torch.stack([_row(i) for i in range(len(NEIGHBOURS) + 1)])  # [9, V]
    alone = int(_sample(batch[-1:], [target])[0])
    for where in (0, 4, len(NEIGHBOURS)):
        rows = NEIGHBOURS[:where] + [target] + NEIGHBOURS[where:]
        order = list(range(where)) + [len(NEIGHBOURS)] + list(range(where, len(NEIGHBOURS)))
        assert int(_sample(batch[order].contiguous(), rows)[where]) == alone, where


def _edge_row() -> torch.Tensor:
    """[VOCAB]: five likely tokens, two of them tied on either side of the chunks' edge, the rest at -20."""
    row = torch.full((VOCAB,), -20.0)
    row[0], row[2000], row[4095], row[4096], row[3000] = 3.0, 2.5, 2.0, 2.0, 1.0
    return row


@pytest.mark.parametrize("top_p,top_k,min_p,support", [
    (1.0, 3, 0.0, {0, 2000, 4095, 4096}),  # the tie at the k-th across the edge kept whole
    (1.0, 4, 0.0, {0, 2000, 4095, 4096}),  # (3000 has 4 likelier)
    (0.99, 3, 0.0, {0, 2000, 4095, 4096}),  # top-p of that set
    (0.85, 0, 0.0, {0, 2000, 4095, 4096}),  # top-p alone (3000 beyond 0.945)
    (0.9, 40, 0.0, {0, 2000, 4095, 4096}),  # a k above K_LIMIT with top_p (torch.topk), ties at -20 kept
    (0.7, 2, 0.3, {0, 2000})])  # min_p, then top-k, then top-p of what both keep
def test_the_kernel_and_the_sort_draw_the_same_support(monkeypatch, top_p, top_k, min_p, support):
    n = 40
    logits = _edge_row().expand(n, -1)
    rows = [(1.0, top_p, top_k, min_p, 100 + i) for i in range(n)]
    drawn = {}
    for flag in (True, False):
        monkeypatch.setattr(sampling, "USE_KERNEL", flag)
        drawn[flag] = set(_sample(logits, rows).tolist())
    assert drawn[True] == drawn[False] == support, drawn


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_draws_follow_the_reference_at_odd_vocabularies_on_cuda(dtype):
    """Compiled (the tests above run the interpreter): 40,000 draws a setting over vocabularies of one
    token, under a block, under a chunk, and over 2,047 / 1 / 4,000 tokens past a chunk's edge, each
    with a tie for the likeliest, follow vLLM's distribution (sampling_reference), never outside
    `allowed`, and so does the sort path (USE_KERNEL False)."""
    from sampling_reference import reference_probs
    from test_rejection_sampling import reference
    from test_sampling_props_hunt import allowed

    n = 40_000
    for vocab in (1, 3, 17, 100, 4095, 4097, 8193):
        base = (torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 2).to(dtype)
        base[vocab // 2] = base.max()
        for t, p, k, m in [(1.0, 0.9, 0, 0.0), (0.7, 1.0, 3, 0.0), (1.0, 0.8, 5, 0.02), (1.3, 0.95, 40, 0.0),
                           (0.9, 0.5, 0, 0.05)]:
            where = (vocab, t, p, k, m)
            rows = base.cuda().expand(n, vocab)
            want = reference_probs(base.float(), t, p, k, m)
            tie_at_the_edge = not torch.allclose(want, reference(base.float(), t, p, m, k))  # (each path its rule)
            for flag in (None, False):  # the kernel (CUDA's default), the sort
                saved, sampling.USE_KERNEL = sampling.USE_KERNEL, flag
                try:
                    ids = sample(rows, [t] * n, [p] * n, [None] * n, [k] * n, [m] * n).cpu()
                finally:
                    sampling.USE_KERNEL = saved
                freq = torch.bincount(ids, minlength=vocab).double() / n
                assert freq[~allowed(base, t, p, k, m)].sum() == 0, (flag, where)
                assert tie_at_the_edge or (freq - want).abs().max() < 0.015, (flag, where)

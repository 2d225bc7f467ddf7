"""paged_attention against a dense causal reference computed without pages (CPU, float32)."""
from __future__ import annotations

import math

import pytest
import torch

from scheduler.attention import AttentionBatch, decode_attention, paged_attention, write_kv

LAYERS, HQ, HKV, D = 2, 4, 2, 16
SCALE = 1.0 / math.sqrt(D)


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of all N positions over the whole sequence, float64, no pages.

    q: [N, Hq, D]; k, v: [N, Hkv, D] -> [N, Hq, D]
    """
    n = q.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # [N, Hq, D]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE  # [Hq, N, N]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


class Seq:
    """One sequence's full q/k/v and its (non-consecutive) pages."""

    def __init__(self, gen: torch.Generator, length: int, pages: list[int]) -> None:
        self.q = torch.randn(length, HQ, D, generator=gen)
        self.k = torch.randn(length, HKV, D, generator=gen)
        self.v = torch.randn(length, HKV, D, generator=gen)
        self.pages = pages
        self.ref = dense_reference(self.q, self.k, self.v)


def make_seqs(lengths: list[int], page_size: int, seed: int = 0) -> tuple[list[Seq], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lengths]
    num_pages = sum(need) * 2 + 3
    perm = torch.randperm(num_pages, generator=gen).tolist()  # random, non-consecutive page order
    seqs, used = [], 0
    for n, p in zip(lengths, need):
        seqs.append(Seq(gen, n, perm[used:used + p]))
        used += p
    pool = torch.zeros(2, LAYERS, num_pages, page_size, HKV, D)  # finite everywhere (module docstring)
    return seqs, pool


def run_step(seqs: list[Seq], pool: torch.Tensor, prefix_lens: list[int], new_lens: list[int],
             is_decode: bool, layer: int = 1) -> list[torch.Tensor]:
    """Writes the new tokens' K/V and attends; returns each sequence's output rows [new, Hq, D]."""
    page_size = pool.shape[3]
    tables = [s.pages[: -(-(p + n) // page_size)] for s, p, n in zip(seqs, prefix_lens, new_lens)]
    batch = AttentionBatch.build(prefix_lens, new_lens, tables, page_size, "cpu", is_decode)
    rows = [slice(p, p + n) for p, n in zip(prefix_lens, new_lens)]
    q = torch.cat([s.q[r] for s, r in zip(seqs, rows)])  # [T, Hq, D]
    k = torch.cat([s.k[r] for s, r in zip(seqs, rows)])  # [T, Hkv, D]
    v = torch.cat([s.v[r] for s, r in zip(seqs, rows)])
    write_kv(pool, layer, k, v, batch.out_slots)
    out = paged_attention(q, pool, layer, batch, SCALE)  # [T, Hq, D]
    assert out.shape == q.shape
    return list(out.split(new_lens))


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_prefill_from_scratch(page_size: int) -> None:
    (seq,), pool = make_seqs([37], page_size)
    (out,) = run_step([seq], pool, [0], [37], is_decode=False)
    check(out, seq.ref)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_prefill_with_cached_prefix(page_size: int) -> None:
    (seq,), pool = make_seqs([45], page_size, seed=1)
    run_step([seq], pool, [0], [20], is_decode=False)  # the prefix lands in random pages first
    (out,) = run_step([seq], pool, [20], [25], is_decode=False)
    check(out, seq.ref[20:])


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_chunked_prefill_then_decode(page_size: int) -> None:
    (seq,), pool = make_seqs([30], page_size, seed=2)
    done = 0
    for chunk in (7, 1, 9, 3):  # a 1-token chunk goes through the batched path inside a prefill
        (out,) = run_step([seq], pool, [done], [chunk], is_decode=False)
        check(out, seq.ref[done:done + chunk])
        done += chunk
    while done < 30:
        (out,) = run_step([seq], pool, [done], [1], is_decode=True)
        check(out, seq.ref[done:done + 1])
        done += 1


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_prefill_batch(page_size: int) -> None:
    lengths = [33, 9, 17, 5, 21]
    prefix = [0, 8, 10, 4, 0]
    new = [33, 1, 7, 1, 21]  # fresh, one-token, cached prefix, one-token, fresh
    seqs, pool = make_seqs(lengths, page_size, seed=3)
    for s, p in zip(seqs, prefix):
        if p:
            run_step([s], pool, [0], [p], is_decode=False)
    outs = run_step(seqs, pool, prefix, new, is_decode=False)
    for s, p, n, out in zip(seqs, prefix, new, outs):
        check(out, s.ref[p:p + n])


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_batch_of_different_lengths(page_size: int) -> None:
    lengths = [1, 2, 19, 40, 6, 16]
    seqs, pool = make_seqs(lengths, page_size, seed=4)
    for s, n in zip(seqs, lengths):
        if n > 1:
            run_step([s], pool, [0], [n - 1], is_decode=False)
    outs = run_step(seqs, pool, [n - 1 for n in lengths], [1] * len(lengths), is_decode=True)
    for s, n, out in zip(seqs, lengths, outs):
        check(out, s.ref[n - 1:n])


def test_decode_padded_row_stays_finite() -> None:
    """A padded decode row (seq_len 0, page 0), as a CUDA-graph batch pads, gives no NaN."""
    pool = torch.randn(2, 1, 4, 4, HKV, D)
    q = torch.randn(2, HQ, D)
    out = decode_attention(q, pool[:, 0], torch.tensor([[2, 1], [0, 0]]), torch.tensor([6, 0]), SCALE)
    assert torch.isfinite(out).all()


def test_write_kv_places_tokens_in_pages() -> None:
    pool = torch.zeros(2, LAYERS, 3, 4, HKV, D)
    batch = AttentionBatch.build([2], [3], [[2, 0]], 4, "cpu", is_decode=False)  # positions 2, 3, 4
    assert batch.out_slots.tolist() == [10, 11, 0]
    assert batch.positions.tolist() == [2, 3, 4]
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    write_kv(pool, 1, k, v, batch.out_slots)
    torch.testing.assert_close(pool[0, 1, 2, 2:4], k[:2])
    torch.testing.assert_close(pool[1, 1, 0, 0], v[2])
    assert pool[:, 0].abs().sum() == 0  # other layers untouched


def test_build_validates() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionBatch.build([0], [9], [[0, 1]], 4, "cpu", is_decode=False)
    with pytest.raises(ValueError, match="decode"):
        AttentionBatch.build([3], [2], [[0, 1]], 4, "cpu", is_decode=True)
    batch = AttentionBatch.build([3, 0], [1, 2], [[5], [1]], 4, "cpu", is_decode=False)
    assert batch.page_tables.tolist() == [[5], [1]]
    assert batch.seq_lens.tolist() == [4, 2]
    assert batch.last_rows.tolist() == [0, 2]

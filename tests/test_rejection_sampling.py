"""kernels/rejection_sampling.py, the sort-free draw of top-p / top-k / min_p rows, under TRITON_INTERPRET=1,
and when `scheduler.sampling.sample` hands a batch to it. The interpreter runs a program (one draw) in
~30 ms, so the frequency checks here are small, on small vocabularies, with fixed seeds (deterministic);
tests/test_gpu_sampling.py draws 20,000 rows over Qwen3's vocabulary on the GPU."""
from __future__ import annotations

import math

import pytest
import torch

from kernels import rejection_sampling
from kernels.rejection_sampling import pack_params, sample_rows, set_kth_logits
from scheduler import sampling
from scheduler.sampling import sample, seeded_generator


def draw(logits: torch.Tensor, rows: list[int], temperature, top_p, min_p, top_k, seeds: list[int],
         **config) -> torch.Tensor:
    """sample_rows over `rows`, each setting a value for every row or a list of one a row (config: the
    kernels' BLOCK, CHUNK, ROUNDS, MAX_ROUNDS)."""
    def each(v):
        return list(v) if isinstance(v, (list, tuple)) else [v] * len(rows)
    min_logs = [math.log(p) if p else -math.inf for p in each(min_p)]
    params = pack_params(rows, each(temperature), each(top_p), min_logs, each(top_k), seeds)
    top_k_rows = [j for j, k in enumerate(each(top_k)) if k]
    set_kth_logits(logits, params, top_k_rows, [each(top_k)[j] for j in top_k_rows], **config)
    return sample_rows(logits, params, **config)


def reference(row: torch.Tensor, temperature: float, top_p: float, min_p: float, top_k: int) -> torch.Tensor:
    """float64 probabilities [V] of vLLM V1's order (temperature, min_p, top-k, top-p), a tie at the
    nucleus' edge kept whole (the kernel's rule; the sort keeps the sort's choice of it)."""
    p = torch.softmax((row.double() - row.double().max()) / temperature, dim=-1)
    keep = p >= min_p * p.max()
    if 0 < top_k < len(p):  # (k >= the vocabulary: every token)
        keep &= p >= torch.where(keep, p, 0.0).sort(descending=True).values[top_k - 1]
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    if top_p < 1.0:
        above = torch.stack([p[p > v].sum() for v in p])
        p = torch.where(keep & (above < top_p), p, 0.0)
    return p / p.sum()


LOGITS = torch.tensor([2.0, 1.4, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize("temperature,top_p,min_p,top_k", [(1.0, 0.7, 0.0, 0), (0.6, 1.0, 0.15, 0),
                                                           (1.3, 1.0, 0.0, 3), (0.9, 0.9, 0.05, 0),
                                                           (1.2, 0.8, 0.0, 5), (0.7, 0.95, 0.02, 6),
                                                           (0.7, 0.9, 0.0, 20)])
def test_draws_follow_the_reference_distribution(temperature, top_p, min_p, top_k):
    n = 160
    # (one round split: the rest in one program; the same draws as any split, tested below, in half the
    # interpreter's time)
    ids = draw(LOGITS.expand(n, -1), list(range(n)), temperature, top_p, min_p, top_k, list(range(1000, 1000 + n)),
               ROUNDS=1)
    want = reference(LOGITS, temperature, top_p, min_p, top_k)
    freq = torch.bincount(ids, minlength=len(LOGITS)).double() / n
    assert freq[want == 0].sum() == 0, (freq, want)  # never outside the kept set
    tolerance = 4 * (want * (1 - want) / n).sqrt() + 0.01
    assert ((freq - want).abs() <= tolerance).all(), (freq, want)


@pytest.mark.parametrize("temperature,top_p,min_p,top_k", [(1.0, 0.7, 0.0, 0), (2.0, 1.0, 0.0, 3),
                                                           (1.5, 0.8, 0.0, 6), (0.9, 0.3, 0.1, 0), (2.0, 1.0, 0.0, 1)])
def test_a_row_split_over_programs_draws_what_one_program_draws(temperature, top_p, min_p, top_k):
    """The same uniforms, so the same draw, whatever the chunks (a program each) and however many rounds
    all of a row's programs take before one program goes on alone: 48 tokens as 1 or 3 chunks of 16,
    1 or 8 rounds split (top_k 1 over 48 tokens needs several)."""
    torch.manual_seed(3)
    n = 12
    logits = torch.randn(n, 48) * 1.5
    seeds = [2**63 + 9 * i for i in range(n)]
    runs = [draw(logits, list(range(n)), temperature, top_p, min_p, top_k, seeds, BLOCK=16, CHUNK=chunk, ROUNDS=rounds)
            for chunk, rounds in ((64, 1), (16, 1), (16, 8), (64, 8))]
    assert all(run.equal(runs[0]) for run in runs[1:]), runs
    if top_k == 1:
        assert runs[0].equal(logits.argmax(dim=-1))


def test_after_max_rounds_rejections_the_likeliest():
    """regression for a path no setting reaches in practice: the top-2 set of this row holds ~4 % of the
    mass, so round 0's draw is nearly always rejected; with MAX_ROUNDS 1 the fallback (the likeliest) is
    the draw, with the default the next round draws 0 or 1 about evenly."""
    row = torch.zeros(48)
    row[0], row[1] = 0.01, 0.005
    n = 24
    capped = draw(row.expand(n, -1), list(range(n)), 1.0, 1.0, 0.0, 2, list(range(n)), MAX_ROUNDS=1)
    free = draw(row.expand(n, -1), list(range(n)), 1.0, 1.0, 0.0, 2, list(range(n)))
    assert set(capped.tolist()) <= {0, 1} and capped.eq(0).sum() >= 20, capped
    assert set(free.tolist()) == {0, 1} and free.eq(1).sum() >= 6, free


def test_a_tiny_top_p_keeps_the_likeliest_and_top_k_1_the_argmax():
    n = 12
    for setting in ((1.0, 1e-9, 0.0, 0), (5.0, 1.0, 0.0, 1), (1.0, 1.0, 1.0, 0)):
        assert draw(LOGITS.expand(n, -1), list(range(n)), *setting, seeds=list(range(n))).eq(0).all()


def test_top_p_with_top_k_takes_the_nucleus_of_the_top_k_set():
    """top-k first, then top-p of what it kept, renormalized (vLLM V1's order): with k 2 the two likeliest
    weigh 0.645 / 0.355, so a top_p of 0.6 keeps the first alone; top-p over the whole row (0.42 / 0.23)
    would keep both."""
    n = 24
    ids = draw(LOGITS.expand(n, -1), list(range(n)), 1.0, 0.6, 0.0, 2, list(range(n)))
    assert ids.eq(0).all(), ids
    ids = draw(LOGITS.expand(n, -1), list(range(n)), 1.0, 0.7, 0.0, 2, list(range(n)))
    assert set(ids.tolist()) == {0, 1}, ids


@pytest.mark.parametrize("k_limit", [128, 4])
def test_the_kth_logit_is_the_rows_kth_largest(monkeypatch, k_limit):
    """set_kth_logits, by the chunk kernels (k <= K_LIMIT; 45 tokens in chunks of 16, one partly past the
    row) or torch.topk: NaN as float32's lowest, +inf clamped, ties as often as they occur, a row without
    top_k or with a k beyond its length: -inf (every token kept)."""
    monkeypatch.setattr(rejection_sampling, "K_LIMIT", k_limit)
    torch.manual_seed(5)
    logits = torch.randn(6, 45)
    logits[1, 3], logits[2, 7], logits[3, :40] = float("nan"), float("inf"), float("-inf")
    logits[4, 10:14] = 9.0  # a 4-way tie for the largest
    clean = torch.nan_to_num(logits, nan=torch.finfo(torch.float32).min)
    ks = [2, 9, 1, 43, 3, 46]
    params = pack_params(list(range(6)), [1.0] * 6, [0.9] * 6, [-math.inf] * 6, ks, list(range(6)))
    set_kth_logits(logits, params, [0, 1, 2, 3, 4, 5], ks, CHUNK=16)
    want = [clean[i].sort(descending=True).values[k - 1].item() if k <= 45 else -math.inf for i, k in enumerate(ks)]
    assert params[7].view(torch.float32).tolist() == want
    assert want[4] == 9.0


def test_a_tie_at_the_kth_logit_is_kept_whole_with_top_p():
    row = torch.tensor([3.0, 1.0, 1.0, 1.0, -2.0, -9.0])
    n = 48
    ids = draw(row.expand(n, -1), list(range(n)), 1.0, 0.99, 0.0, 2, list(range(n)))
    assert set(ids.tolist()) == {0, 1, 2, 3}, ids  # the three tied with the 2nd stay; token 4 never


def test_a_tie_at_the_nucleus_edge_is_kept_whole():
    row = torch.tensor([1.0, 1.0, -2.0, -2.0, -4.0])
    n = 40
    ids = draw(row.expand(n, -1), list(range(n)), 1.0, 0.3, 0.0, 0, list(range(n)))
    assert set(ids.tolist()) == {0, 1}


def test_non_finite_logits_and_extreme_temperatures():
    rows = torch.tensor([[0.0, float("inf"), 1.0, float("nan")],  # +inf: the likeliest by far
                         [float("nan")] * 4,  # nothing but NaN: any token (the caller fails the request)
                         [float("-inf"), 0.5, 0.4, float("-inf")],
                         [0.1, 0.2, 0.3, 0.25]])
    for seed in range(6):
        ids = draw(rows, [0, 1, 2, 3], [1.0, 1.0, 1.0, torch.finfo(torch.float32).tiny], [0.9, 0.9, 0.9, 0.5], 0.0,
                   0, [seed] * 4)
        assert ids[0] == 1 and 0 <= ids[1] < 4 and ids[2] in (1, 2) and ids[3] == 2, ids


def test_a_rows_draw_depends_on_its_seed_not_on_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 40) * 2
    setting = ([1.0, 0.7, 1.2, 0.9, 1.0], [0.9, 1.0, 0.5, 1.0, 0.8], [0.0, 0.1, 0.0, 0.0, 0.0], [0, 0, 0, 4, 0])
    seeds = [11, 22, 33, 44, 2**64 - 5]
    together = draw(logits, list(range(5)), *setting, seeds)
    for i in range(5):
        alone = draw(logits, [i], *([v[i]] for v in setting), [seeds[i]])
        assert alone[0] == together[i]
    assert any(not draw(logits, list(range(5)), *setting, [x + k for x in seeds[:4]] + [k]).equal(together)
               for k in (1, 2))  # (another seed, another draw: at least once in two)


@pytest.fixture
def kernel_on(monkeypatch):
    monkeypatch.setattr(sampling, "USE_KERNEL", True)


def test_sample_hands_the_top_p_and_top_k_rows_to_the_kernel(kernel_on, monkeypatch):
    calls = []
    real = rejection_sampling.sample_rows
    monkeypatch.setattr(rejection_sampling, "sample_rows", lambda *a, **k: calls.append(a) or real(*a, **k))
    logits = LOGITS.expand(6, -1).contiguous()
    # greedy; top_p; top_k; temperature only; min_p only; top_k and top_p
    ids = sample(logits, [0.0, 1.0, 0.8, 1.0, 1.0, 1.0], [1.0, 0.9, 1.0, 1.0, 1.0, 0.6], [None] * 6,
                 [0, 0, 3, 0, 0, 2], [0.0, 0.0, 0.0, 0.0, 0.1, 0.0])
    assert len(calls) == 1 and calls[0][1][4].tolist() == [1, 2, 5]  # rows 1, 2, 5; the others by the torch path
    kth = calls[0][1][7].view(torch.float32).tolist()  # the k-th logit found for row 5 only (top-k and top-p)
    assert kth == [-math.inf, -math.inf, LOGITS[1].item()]
    assert ids[0] == 0 and ids[5] == 0 and ((ids >= 0) & (ids < len(LOGITS))).all()
    monkeypatch.setattr(sampling, "USE_KERNEL", None)  # the default: CUDA only
    sample(logits, [1.0], [0.9], [None])
    assert len(calls) == 1


def test_a_seeded_row_takes_its_path_whatever_shares_its_batch(kernel_on):
    """regression (the property hunt below, through the kernel): a batch went to the kernel or to the sort
    as a whole, by whether any row had both top-k and top-p; a seeded top-p row drew one token beside such
    a row and another alone."""
    logits = torch.zeros(2, 18)
    logits[1, 9] = logits[1, 15] = 3e38
    params = dict(temperatures=[5e-324, 5e-324], top_ps=[1e-147, 0.83], top_ks=[2, 0])
    batch = sample(logits, params["temperatures"], params["top_ps"], [None, seeded_generator(0, torch.device("cpu"))],
                   params["top_ks"])
    alone = sample(logits[1:], [5e-324], [0.83], [seeded_generator(0, torch.device("cpu"))], [0])
    assert batch[1] == alone[0]


def test_a_seeded_request_draws_the_same_alone_and_in_a_batch_through_sample(kernel_on):
    torch.manual_seed(1)
    logits = torch.randn(4, 48) * 2
    temps, top_ps = [1.0, 0.0, 0.8, 1.1], [0.9, 1.0, 0.95, 0.7]
    gens = [seeded_generator(7, torch.device("cpu")), None, None, seeded_generator(2**40 + 3, torch.device("cpu"))]
    batch = sample(logits, temps, top_ps, gens)
    gens_alone = [seeded_generator(7, torch.device("cpu")), seeded_generator(2**40 + 3, torch.device("cpu"))]
    assert batch[0] == sample(logits[0:1], [1.0], [0.9], [gens_alone[0]])[0]
    assert batch[3] == sample(logits[3:4], [1.1], [0.7], [gens_alone[1]])[0]
    assert batch[1] == logits[1].argmax()


def test_sample_properties_through_the_kernel():
    """tests/test_sampling_props_hunt.py's property hunt (random batches with ties, NaN, +-inf, three dtypes,
    greedy / seeded / unseeded rows, any temperature, top_p, top_k, min_p) with the kernel drawing every
    batch it takes: each token within the reference's support (a tie at the edge kept whole), top_k 1 and
    min_p 1 an argmax, a seeded row the same alone as in its batch. 30 derandomized examples of at most 24
    tokens in CI (the interpreter takes ~30 ms a draw); SAMPLING_PROPS_EXAMPLES=N runs N of any size."""
    import os

    from hypothesis import HealthCheck, given, settings

    from test_sampling_props_hunt import batches, test_sample_properties

    examples = int(os.environ.get("SAMPLING_PROPS_EXAMPLES", 0))
    small = batches().filter(lambda b: b[0].shape[-1] <= 24)

    @settings(max_examples=examples or 30, deadline=None, derandomize=not examples,
              suppress_health_check=list(HealthCheck))
    @given(batch=batches() if examples else small)
    def check(batch):
        test_sample_properties.hypothesis.inner_test(batch)

    saved = sampling.USE_KERNEL
    sampling.USE_KERNEL = True
    try:
        check()
    finally:
        sampling.USE_KERNEL = saved


def _hash32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def check_uniforms_equal_the_reference(device: str) -> None:
    """The kernel's counter-hash uniforms (`_uniform`) against a Python reference of the same hash, over
    counters past 2**31 and keys with the top bit set: uint32 arithmetic, on `device` (the compiler types
    the constants; the interpreter is numpy)."""
    import triton
    import triton.language as tl

    @triton.jit
    def uniforms(out_ptr, base, key_lo, key_hi, N: tl.constexpr):
        offs = tl.arange(0, N)
        u = rejection_sampling._uniform(offs.to(tl.uint32) + base.to(tl.uint32), key_lo.to(tl.uint32),
                                        key_hi.to(tl.uint32))
        tl.store(out_ptr + offs, u)

    for base, lo, hi in ((0, 0, 0), (2**31 - 8, 0x89ABCDEF, 0xFEDCBA98), (123456789, 0x12345678, 0x0ABCDEF0)):
        out = torch.empty(64, device=device)
        uniforms[(1,)](out, base, lo, hi, N=64)
        want = [(_hash32_reference(_hash32_reference(((base + i) & 0xFFFFFFFF) ^ lo) ^ hi) >> 8) / 2**24
                for i in range(64)]
        assert out.cpu().tolist() == want


def test_the_kernels_uniforms_are_the_hash_they_document():
    check_uniforms_equal_the_reference("cpu")


def test_a_uniform_of_0_does_not_win_the_race():
    """regression (review): `_uniform` is 0 once in 2**24 tokens, and its Exp(1) draw was clamped at float32's
    smallest normal: log q = -87 beat every other token's score, so about one race in a hundred over 151,936
    tokens went to a token of any probability. Under this key token 1815 of 4,096 draws u = 0; the row
    puts all but ~2e-14 of its mass on token 0."""
    row = torch.full((1, 4096), -40.0)
    row[0, 0] = 0.0
    for top_k in (4095, 100):
        assert draw(row, [0], 1.0, 1.0, 0.0, top_k, [9187157742993245334])[0] == 0


def test_a_top_p_that_float32_rounds_to_0_draws_the_likeliest():
    """A top_p of 1e-46 is 0 in float32: the likeliest token all the same (the kernel keeps it at once
    since the review: before, it was reached only by MAX_ROUNDS rejections and the fallback, which no
    test can tell apart but by time)."""
    row = torch.tensor([[0.3, 2.0, -1.0, 1.9, 0.0, 0.5, -3.0, 1.0]])
    for top_p in (1e-46, 1e-300, 1e-30):
        assert draw(row, [0], 1.0, top_p, 0.0, 0, [7])[0] == 1


def test_the_kth_logit_is_found_for_the_rows_asked_only():
    """regression: the chunk kernels read every row's top_k from params, so a top-k-only row (k 2) beside a
    row with both top-k and top-p (k 3) got a k-th logit too, and its draw took another path than alone."""
    params = pack_params([0, 1], [1.0, 1.0], [1.0, 0.6], [-math.inf] * 2, [2, 3], [7, 8])
    set_kth_logits(LOGITS.expand(2, -1).contiguous(), params, [1], [3])
    assert params[7].view(torch.float32).tolist() == [-math.inf, LOGITS[2].item()]

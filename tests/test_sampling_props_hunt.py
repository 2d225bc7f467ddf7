"""Property hunt of scheduler/sampling.py `sample`: random batches (1..6 rows of 1..24, 100 or 1000 tokens;
float32, float16 or bfloat16 logits with ties, huge values, -inf, +inf and NaN) mixing greedy rows, seeded
rows (the engine's CPU generators, `seeded_generator`) and unseeded ones, at temperatures across (0, 100]
(float32's subnormal and rounded-to-0 ones too), top_p in (0, 1], top_k in [-1, V + 5] and min_p in [0, 1].
For every batch:

* the input logits are left as they were, the ids are int64 [B] in [0, V);
* a greedy row takes an argmax of its row (any NaN: argmax's NaN index, which `mark_nan` fails);
* a sampled row's token has a nonzero probability under tests/sampling_reference.py's `reference_probs`
  (a NaN counted as -inf, as `sample` documents; a row with +inf draws among its +inf tokens, a row of
  nothing but -inf or NaN draws anything); top_k 1 or min_p 1 takes an argmax;
* a seeded row draws the same token alone (a fresh generator of its seed) as in its batch, and the same
  with top_k 0, -1 or >= V and min_p 0 as with no top_k / min_p at all.

`reference_probs` runs on the tempered row as `sample` computes it in float32 ((x - max) / t: near-ties that
float32 rounds together are ties for both), with top_p and min_p relaxed by 1e-5 (float32's cumulative sum
and log against float64's at a boundary are not a bug).

SAMPLING_PROPS_EXAMPLES=N runs N random examples (the hunt ran 20,000 by hand); CI runs 150, derandomized.
"""
from __future__ import annotations

import math
import os

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from sampling_reference import reference_probs
from scheduler.sampling import _top_k_top_p, sample, seeded_generator

EXAMPLES = int(os.environ.get("SAMPLING_PROPS_EXAMPLES", 150))
TINY = torch.finfo(torch.float32).tiny
RELAX = 1e-5

_values = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 2.5, 2.5, -30.0]),  # ties
                    st.floats(-60, 60, width=32),
                    st.sampled_from([3e38, -3e38, 1e30, -1e30, -3.4028234663852886e38, 1e-40]),
                    st.sampled_from([-math.inf, -math.inf, math.inf, math.nan]))
_temperatures = st.one_of(st.floats(0.0, 100.0, exclude_min=True),
                          st.sampled_from([1e-45, 1e-40, TINY, 1e-10, 0.01, 0.7, 1.0, 1.5, 100.0]))
_top_ps = st.one_of(st.floats(0.0, 1.0, exclude_min=True), st.sampled_from([1e-46, 1e-3, 0.5, 0.9, 1.0, 1.0]))
_min_ps = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.0, 1e-300, 0.05, 0.5, 1.0]))


@st.composite
def batches(draw):
    vocab = draw(st.one_of(st.integers(1, 24), st.sampled_from([100, 1000])))
    rows = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    row_kind = st.sampled_from(["finite", "finite", "with_specials", "flat", "randn", "randn"])
    logits = []
    for _ in range(rows):
        kind = draw(row_kind)
        if kind == "flat":
            logits.append([draw(_values)] * vocab)
        elif kind == "randn" or vocab > 24:  # (a wide row: normal logits, maybe rounded into ties, a few specials)
            vals = torch.randn(vocab, generator=torch.Generator().manual_seed(draw(st.integers(0, 1 << 20))))
            vals = vals * draw(st.sampled_from([0.1, 1.0, 3.0, 30.0]))
            vals = (vals.round() if draw(st.booleans()) else vals).tolist()
            for _ in range(draw(st.integers(0, 3))):
                vals[draw(st.integers(0, vocab - 1))] = draw(_values)
            logits.append(vals)
        else:
            vals = draw(st.lists(_values, min_size=vocab, max_size=vocab))
            if kind == "finite":
                vals = [v if math.isfinite(v) else 0.5 for v in vals]
            logits.append(vals)
    params = []
    for _ in range(rows):
        how = draw(st.sampled_from(["greedy", "seeded", "seeded", "unseeded"]))
        seed = draw(st.integers(-(1 << 63), (1 << 64) - 1)) if how == "seeded" else None
        params.append((0.0 if how == "greedy" else draw(_temperatures), draw(_top_ps), draw(st.integers(-1, vocab + 5)),
                       draw(_min_ps), seed))
    return torch.tensor(logits, dtype=torch.float64).to(dtype), params, draw(st.integers(0, 1 << 30))


def run_sample(logits: torch.Tensor, params: list[tuple], top_ks=None, min_ps=None) -> torch.Tensor:
    """`sample` as the runner calls it, each seeded row with a fresh generator of its seed."""
    return sample(logits, [p[0] for p in params], [p[1] for p in params],
                  [None if p[4] is None else seeded_generator(p[4], logits.device) for p in params],
                  [p[2] for p in params] if top_ks is None else top_ks,
                  [p[3] for p in params] if min_ps is None else min_ps)


def tempered(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """[V] float64: the row as `sample` tempers it in float32 (NaN as -inf: no probability)."""
    x = row.float().nan_to_num(nan=-math.inf, posinf=math.inf)
    return ((x - x.max()) / max(temperature, TINY)).double()


def allowed(row: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """[V] bool: the tokens a sampled row may draw. A row with +inf: its +inf tokens; of nothing but -inf and
    NaN: any; else the reference's support (over the float32-tempered row, relaxed at the boundaries) and the
    tokens tied with one in it (which of a tie top-p keeps is the sort's choice, as in vLLM)."""
    x = row.float()
    if torch.isposinf(x).any():
        return torch.isposinf(x)
    if not torch.isfinite(x).any():
        return torch.ones_like(x, dtype=torch.bool)
    z = tempered(row, temperature)
    support = reference_probs(z, 1.0, min(1.0, top_p + RELAX), top_k, min_p * (1 - RELAX)) > 0
    p = torch.softmax(z, dim=-1)  # [V] float64: ties as the reference sees them (-1e-40 and 0 alike)
    return support | torch.isin(p, p[support])


@settings(max_examples=EXAMPLES, deadline=None, derandomize="SAMPLING_PROPS_EXAMPLES" not in os.environ,
          suppress_health_check=list(HealthCheck))
@given(batch=batches())
def test_sample_properties(batch):
    logits, params, torch_seed = batch
    vocab = logits.shape[-1]
    before = logits.clone()
    torch.manual_seed(torch_seed)
    ids = run_sample(logits, params)
    assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(), before.nan_to_num())
    assert ids.dtype == torch.int64 and ids.shape == (len(params),)
    assert ((ids >= 0) & (ids < vocab)).all(), ids
    for i, (t, p, k, m, seed) in enumerate(params):
        row, token = logits[i], int(ids[i])
        where = f"row {i} {row.tolist()} t {t} top_p {p} top_k {k} min_p {m} seed {seed}: drew {token}"
        if t == 0.0:  # (a NaN anywhere: argmax takes one)
            assert row[token].isnan() if row.isnan().any() else row[token] == row.max(), where
            continue
        assert allowed(row, t, p, k, m)[token], where
        x = row.float().nan_to_num(nan=-math.inf)
        if (k == 1 or m == 1.0) and torch.isfinite(x).any():
            assert x[token] == x.max(), where
        if seed is None:
            continue
        alone = run_sample(logits[i:i + 1], [params[i]])
        assert int(alone[0]) == token, f"{where}; alone {int(alone[0])}"
        if k in (0, -1) or k >= vocab or m == 0.0:  # neutral values: exactly what leaving them out draws
            plain = run_sample(logits[i:i + 1], [params[i]], top_ks=[] if k in (0, -1) or k >= vocab else [k],
                               min_ps=[] if m == 0.0 else [m])
            assert int(plain[0]) == token, f"{where}; without its neutral top_k / min_p {int(plain[0])}"


def test_a_top_p_of_1_keeps_every_token_beside_a_nucleus_row():
    """Regression (found writing this hunt, by reading `sample`: a draw shows it about once in 4e7): a top_p 1.0
    row in a batch with a top_p < 1 row went through the nucleus, where float32's running sum reaches 1.0
    before the least likely tokens (p0 rounds to 1.0 here, p1 is 2.5e-8): they were dropped, so a seeded
    row's draw depended on its batch (alone, or beside top_p 1 rows only, the nucleus is skipped and every
    token kept), and it differed from vLLM's (top_p 1: all)."""
    x = torch.tensor([[0.0, -17.5], [0.0, -17.5]])  # [S, V] tempered: the likeliest at 0
    kept = _top_k_top_p(x, torch.tensor([[1], [1]]), torch.tensor([[1.0], [0.5]]), False, True,
                         x.new_full((), -math.inf))
    assert kept[0].tolist() == [0.0, -17.5] and kept[1].tolist() == [0.0, -math.inf]

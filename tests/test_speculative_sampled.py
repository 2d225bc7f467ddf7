"""Speculative decoding of sampled requests (scheduler/speculative.py): the rows' layout; a verify step's sampled rows,
drawn as plain steps draw and taken by `accept`, give each token the plain step's distribution (rejection sampling
of a one-token draft; fixed seeds: the counts are deterministic, the bounds ~4 standard errors); and the tiny CPU
engine: unseeded sampled requests verify, top_k 1 gives the greedy output, greedy neighbours in one verify step
keep theirs, seeded requests decode plainly."""
from __future__ import annotations


import pytest
import torch

from scheduler.request import SamplingParams
from scheduler.sampling import sample
from scheduler.speculative import accept, eligible, sampled_rows
from test_speculative import SPEC, VOCAB, looping_prompts, make_engine, record_steps, spec_stats

ROWS = [[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],  # three rows' raw logits (a vocabulary of 8)
        [-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0],
        [0.0] * 8]
DRAWS = 40_000


def distribution(logits: list[float], temperature: float, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """A plain step's distribution, by its filters (vLLM's order: temperature, min_p, top-k, top-p)."""
    p = torch.softmax(torch.tensor(logits) / temperature, dim=-1)
    p = torch.where(p < min_p * p.max(), 0.0, p)
    if top_k:
        p = torch.where(p < p.topk(top_k).values[-1], 0.0, p)
    p = p / p.sum()
    ordered, order = p.sort(descending=True)
    keep = (ordered.cumsum(0) - ordered < top_p)
    keep[0] = True
    p = torch.zeros_like(p).scatter(0, order, torch.where(keep, ordered, 0.0))
    return p / p.sum()


def close(got: torch.Tensor, want: torch.Tensor, n: int) -> bool:
    return bool(((got - want).abs() <= 4 * (want * (1 - want) / n).sqrt() + 1e-9).all())


# -- layout -------------------------------------------------------------------------------------------------
def test_sampled_rows_packed_and_in_a_graphs_layout():
    new_lens, temps = [3, 2, 4], [0.7, 0.0, 1.0]  # the greedy middle sequence keeps its argmax
    assert sampled_rows(new_lens, temps, 0) == ([0, 1, 2, 5, 6, 7, 8], [0, 0, 0, 2, 2, 2, 2])
    assert sampled_rows(new_lens, temps, 4) == ([0, 1, 2, 8, 9, 10, 11], [0, 0, 0, 2, 2, 2, 2])  # (from row 4 b)
    assert sampled_rows(new_lens, [0.0] * 3, 4) == ([], [])


# -- the distribution ---------------------------------------------------------------------------------------
FILTERS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(temperature=1.3, top_k=3),
           dict(temperature=1.0, min_p=0.2), dict(temperature=0.5, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("drafts", [(0, 7), (2, 5), (6, 0)])
def test_a_verify_steps_tokens_have_the_plain_steps_joint_distribution(filters, drafts):
    """DRAWS verify steps of drafts (d1, d2) over rows with distributions p0, p1, p2, their rows drawn as the
    runner draws them: P(first token a) = p0(a); P(d1 then b) = p0(d1) p1(b); P(d1, d2, then c) =
    p0(d1) p1(d2) p2(c): the joint distribution of three plain steps. A rejected draft's row gives another
    token (nothing outside the filters ever)."""
    f = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, **filters}
    p0, p1, p2 = (distribution(r, **f) for r in ROWS)
    torch.manual_seed(1)
    n = 3 * DRAWS
    logits = torch.tensor(ROWS * DRAWS)  # step s's rows at 3 s .. 3 s + 2
    tokens = sample(logits, [f["temperature"]] * n, [f["top_p"]] * n, [None] * n, [f["top_k"]] * n,
                    [f["min_p"]] * n).view(DRAWS, 3).tolist()
    steps = [accept(list(drafts), row) for row in tokens]
    d1, d2 = drafts
    first = torch.bincount(torch.tensor([s[0] for s in steps]), minlength=8).double() / DRAWS
    second = torch.bincount(torch.tensor([s[1] for s in steps if len(s) > 1], dtype=torch.int64), minlength=8).double() / DRAWS
    third = torch.bincount(torch.tensor([s[2] for s in steps if len(s) > 2], dtype=torch.int64), minlength=8).double() / DRAWS
    assert close(first, p0, DRAWS), (first, p0)
    assert close(second, p0[d1] * p1, DRAWS), (second, p0[d1] * p1)
    assert close(third, p0[d1] * p1[d2] * p2, DRAWS), (third, p0[d1] * p1[d2] * p2)
    assert all(s[:-1] == list(drafts[:len(s) - 1]) for s in steps)  # the drafts up to the first miss
    assert all(len(s) == 3 or s[-1] != drafts[len(s) - 1] for s in steps)  # then a token that is not the draft
    assert not any(p0[s[0]] == 0 or (len(s) > 1 and p1[s[1]] == 0) for s in steps)


def test_the_reference_distribution_is_the_samplers():
    """(The test's own `distribution`, against the sampler's draws: a bug in either shows here.)"""
    torch.manual_seed(2)
    for f in FILTERS:
        f = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, **f}
        logits = torch.tensor([ROWS[0]] * DRAWS)
        got = torch.bincount(sample(logits, [f["temperature"]] * DRAWS, [f["top_p"]] * DRAWS, [None] * DRAWS,
                                    [f["top_k"]] * DRAWS, [f["min_p"]] * DRAWS), minlength=8).double() / DRAWS
        assert close(got, distribution(ROWS[0], **f), DRAWS), f


# -- who speculates ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("params, want", [
    (SamplingParams(temperature=0.8), True),
    (SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05), True),
    (SamplingParams(temperature=0.8, seed=3), False),  # (its tokens must not depend on what else runs)
    (SamplingParams(temperature=0.0, seed=3), True),   # (greedy: the seed draws nothing)
    (SamplingParams(temperature=0.8, logprobs=1), True),  # (each token's logprobs from the row that chose it)
    (SamplingParams(temperature=0.8, presence_penalty=0.5), True),  # (each row scored after its drafts)
    (SamplingParams(temperature=0.8, allowed_token_ids=[1, 2]), True),  # (each row's bans after its drafts)
])
def test_eligible(params, want):
    assert eligible(params) is want


# -- the engine ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain():
    return make_engine()


@pytest.fixture(scope="module")
def looping():
    return looping_prompts(5, 20, 8, 32, need=3)[:4]


def test_sampled_top_k_1_verifies_and_gives_the_greedy_output(plain, looping, monkeypatch):
    """top_k 1 leaves one token a row: a draft is accepted exactly when greedy decoding would give it, and a
    replacement is the greedy token. Any misplaced row (another row's draft, another sequence's parameters)
    changes the output."""
    eng = make_engine(SPEC)
    steps = record_steps(monkeypatch)
    torch.manual_seed(6)
    got = eng.generate(looping, SamplingParams(max_tokens=20, temperature=0.9, top_k=1))
    want = plain.generate(looping, SamplingParams(max_tokens=20))
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    stats = spec_stats(eng)
    assert stats["drafts"] > 0 and stats["accepted_tokens"] > 0 and steps
    eng.check_integrity()


def test_sampled_and_greedy_sequences_share_a_verify_step(plain, looping, monkeypatch):
    eng = make_engine(SPEC)
    steps = record_steps(monkeypatch)
    torch.manual_seed(7)
    prompts = [looping[0], looping[1], looping[2], looping[1]]
    params = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=1.0),
              SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=0.5, top_p=0.8, min_p=0.1)]
    got = eng.generate(prompts, params)
    want = plain.generate([looping[0], looping[2]], SamplingParams(max_tokens=20))
    assert [got[0].output_ids, got[2].output_ids] == [r.output_ids for r in want]
    [greedy] = plain.generate([looping[1]], SamplingParams(max_tokens=20))
    assert got[1].output_ids != greedy.output_ids  # (drawn at temperature 1 over 512 tokens, not taken greedily)
    assert all(r.error is None and len(r.output_ids) == 20 for r in got)
    assert all(0 <= t < VOCAB for r in got for t in r.output_ids)
    by_rid = {s.rid for s in steps}
    assert {got[1].rid, got[3].rid} <= by_rid  # (the sampled ones verified too)
    for s in steps:  # a step's tokens: the accepted drafts, then one that is not the next draft
        n = len(s.yielded) - 1
        assert s.yielded[:n] == s.draft[:n] and (n == len(s.draft) or s.yielded[n] != s.draft[n])
    eng.check_integrity()


def test_seeded_sampled_requests_decode_plainly_with_the_plain_engines_tokens(plain, looping):
    eng = make_engine(SPEC)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=9)
    got = eng.generate(looping[:2], params)
    assert spec_stats(eng)["verify_steps"] == 0
    assert [r.output_ids for r in got] == [r.output_ids for r in plain.generate(looping[:2], params)]

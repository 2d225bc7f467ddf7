"""vLLM's top_k and min_p (SamplingParams; the API's extra fields), and the sampled rows of a batch drawn
together (scheduler/sampling.py `sample`): empirical frequencies against a float64 reference of vLLM V1's
order (temperature, min_p, top-k, top-p), a seeded row's draws whatever shares its batch, ties, the bounds;
then in the engine (tiny preset, CPU) and over HTTP."""
from __future__ import annotations

import math

import httpx
import pytest
import torch

from sampling_reference import VOCAB, reference_probs
from scheduler.request import RequestError, SamplingParams
from scheduler.sampling import sample
from test_penalties import PROMPTS, make_engine, run, srv  # noqa: F401  (srv: the fixture)

CASES = [  # (temperature, top_p, top_k, min_p)
    (1.0, 1.0, 0, 0.0), (0.7, 1.0, 3, 0.0), (1.3, 1.0, 0, 0.2), (1.0, 0.8, 5, 0.0), (1.0, 0.6, 0, 0.05),
    (2.0, 0.9, 4, 0.1), (1.0, 1.0, VOCAB, 0.0), (1.0, 1.0, -1, 0.0), (0.5, 1.0, 1, 0.0), (1.0, 1.0, 0, 1.0)]


@pytest.mark.parametrize("temperature,top_p,top_k,min_p", CASES)
def test_draws_follow_vllms_distribution(temperature, top_p, top_k, min_p):
    """20,000 draws of one row (a batch of its copies, unseeded): each token's frequency within 0.02
    of the reference (about 6 sd at worst), and a token the reference rules out never drawn."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(hash((temperature, top_k)) % 1000)) * 2
    n = 20_000
    torch.manual_seed(0)
    ids = sample(logits.expand(n, VOCAB), [temperature] * n, [top_p] * n, [None] * n, [top_k] * n, [min_p] * n)
    freq = torch.bincount(ids, minlength=VOCAB).double() / n
    want = reference_probs(logits, temperature, top_p, top_k, min_p)
    assert (freq[want == 0] == 0).all(), (freq, want)
    assert (freq - want).abs().max() < 0.02, (freq, want)


def test_top_p_is_taken_over_what_top_k_left():
    """p = (0.4, 0.3, 0.2, 0.1): top_k 2 leaves (0.57, 0.43), so top_p 0.5 keeps the first alone (over the
    whole row it would keep two)."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    n = 2000
    torch.manual_seed(1)
    assert sample(logits.expand(n, 4), [1.0] * n, [0.5] * n, [None] * n, [2] * n).eq(0).all()
    both = sample(logits.expand(n, 4), [1.0] * n, [0.5] * n, [None] * n)
    assert set(both.tolist()) == {0, 1}


def test_top_k_keeps_ties_with_the_kth_and_min_p_1_keeps_the_likeliest():
    logits = torch.tensor([2.0, 2.0, 1.0, 0.0])
    n = 2000
    torch.manual_seed(2)
    assert set(sample(logits.expand(n, 4), [1.0] * n, [1.0] * n, [None] * n, [1] * n).tolist()) == {0, 1}
    assert set(sample(logits.expand(n, 4), [1.0] * n, [1.0] * n, [None] * n, min_ps=[1.0] * n).tolist()) == {0, 1}


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    """Each seeded row's q comes from its own generator: drawn alone or among greedy, unseeded and other
    seeded rows with other parameters, step after step, it takes the same tokens; and top_k 0, -1 and
    >= the vocabulary draw exactly what no top_k draws."""
    torch.manual_seed(3)
    rows = [(0.0, 1.0, 0, 0.0, None), (1.0, 0.9, 4, 0.0, 11), (0.8, 1.0, 0, 0.1, None), (1.5, 1.0, 0, 0.0, 12),
            (1.0, 0.7, 2, 0.05, 13), (1.2, 1.0, 3, 0.0, None)]
    alone_gens = {i: torch.Generator().manual_seed(r[4]) for i, r in enumerate(rows) if r[4] is not None}
    batch_gens = [None if r[4] is None else torch.Generator().manual_seed(r[4]) for r in rows]
    for _ in range(40):
        logits = torch.randn(len(rows), VOCAB) * 3
        got = sample(logits, [r[0] for r in rows], [r[1] for r in rows], batch_gens, [r[2] for r in rows],
                     [r[3] for r in rows])
        assert got[0] == logits[0].argmax()  # greedy
        for i, gen in alone_gens.items():
            t, p, k, m, _ = rows[i]
            assert got[i] == sample(logits[i:i + 1], [t], [p], [gen], [k], [m])[0]
    logits = torch.randn(1, VOCAB)
    draws = {k: [int(sample(logits, [1.0], [1.0], [g], [k])[0]) for _ in range(30)]
             for k, g in [(0, torch.Generator().manual_seed(5)), (-1, torch.Generator().manual_seed(5)),
                          (VOCAB, torch.Generator().manual_seed(5)), (VOCAB + 7, torch.Generator().manual_seed(5))]}
    assert len({tuple(d) for d in draws.values()}) == 1 and len(set(draws[0])) > 1


@pytest.mark.parametrize("bad", [{"top_k": -2}, {"top_k": 1.5}, {"top_k": True}, {"top_k": "3"}, {"top_k": None},
                                 {"min_p": -0.1}, {"min_p": 1.01}, {"min_p": math.nan}, {"min_p": "0.1"},
                                 {"min_p": None}])
def test_a_bad_value_is_a_request_error_naming_the_field(bad):
    with pytest.raises(RequestError) as err:
        SamplingParams(**bad).validate(16)
    assert err.value.param == next(iter(bad))


# -- the engine --------------------------------------------------------------------------------------------
def test_in_the_engine_top_k_1_and_min_p_1_sample_the_greedy_tokens():
    """Sampled at temperature 1.5 (seeded or not), top_k 1 or min_p 1 leaves the likeliest token alone:
    the greedy output, in a batch that mixes them with plain sampled and greedy rows."""
    eng = make_engine()
    greedy = run(eng, PROMPTS, [SamplingParams(max_tokens=10, ignore_eos=True)] * len(PROMPTS))
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.5, top_k=1, seed=4),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.5, min_p=1.0),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.5, seed=5),
              SamplingParams(max_tokens=10, ignore_eos=True)]
    out = run(eng, PROMPTS[:4], params)
    assert out[0] == greedy[0] and out[1] == greedy[1] and out[3] == greedy[3]
    assert out[2] != greedy[2]  # plain sampling at 1.5 over the tiny preset's flat logits leaves greedy
    again = run(eng, PROMPTS[:4], params)
    assert again[0] == out[0] and again[2] == out[2]  # seeded rows repeat
    assert eng.stats["chained_steps"] > 0
    eng.check_integrity()


# -- HTTP ------------------------------------------------------------------------------------------------
HI = [{"role": "user", "content": "hi"}]


def _post(srv, chat: bool, body: dict) -> httpx.Response:
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": PROMPTS[0]})
    return httpx.post(srv.url + path, json={**base, "max_tokens": 6, "ignore_eos": True, **body}, timeout=60)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_api_takes_top_k_and_min_p(srv, chat):
    greedy = _post(srv, chat, {"temperature": 0})
    assert greedy.status_code == 200, greedy.text
    ids = greedy.json()["choices"][0]["token_ids"]
    for fields in ({"top_k": 1}, {"min_p": 1}, {"min_p": 1.0, "top_k": 3, "top_p": 0.9}):
        r = _post(srv, chat, {"temperature": 1.5, "seed": 9, **fields})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ids, fields
    neutral = _post(srv, chat, {"temperature": 1.5, "seed": 9, "top_k": -1, "min_p": 0, "n": 2})
    plain = _post(srv, chat, {"temperature": 1.5, "seed": 9, "top_k": None, "min_p": None, "n": 2})
    assert neutral.status_code == plain.status_code == 200, (neutral.text, plain.text)
    assert [c["token_ids"] for c in neutral.json()["choices"]] == [c["token_ids"] for c in plain.json()["choices"]]


BAD_HTTP = [(chat, field, value, code) for chat in (False, True) for field, value, code in [
    ("top_k", -2, "invalid_value"), ("top_k", 1.5, "invalid_type"), ("top_k", "3", "invalid_type"),
    ("top_k", True, "invalid_type"), ("min_p", 1.5, "invalid_value"), ("min_p", -0.1, "invalid_value"),
    ("min_p", "0.1", "invalid_type"), ("min_p", False, "invalid_type")]]


@pytest.mark.parametrize("chat,field,value,code", BAD_HTTP,
                         ids=[f"{'chat' if c else 'cmpl'}-{f}-{v!r}" for c, f, v, _ in BAD_HTTP])
def test_a_bad_value_is_a_400_naming_the_field(srv, chat, field, value, code):
    r = _post(srv, chat, {"temperature": 1.0, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == code, err

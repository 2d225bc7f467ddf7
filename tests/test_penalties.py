"""Presence, frequency and repetition penalties (SamplingParams.presence_penalty / frequency_penalty /
repetition_penalty; the API's fields of the same names), served as vLLM serves them: presence and
frequency over the tokens generated so far, repetition over the prompt's and the generated tokens, on
the logits before temperature / top-p and before greedy's argmax; logprobs stay the raw logits'. The
in-process API on the CPU (tiny preset) against a host reference over a dense forward, with decode
chained on the device (the in-flight token's id is only there), then the HTTP fields."""
from __future__ import annotations

import json
import math
from collections import Counter

import httpx
import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams
from server_fixtures import byte_level_server, tiny_config

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 7, 300, 12, 13], [9, 8, 7, 6, 5, 4, 3, 2, 1]]


def make_engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, **kw))


def run(eng: Engine, prompts, params) -> list[list[int]]:
    """Every prompt submitted at once (one batch): each request's output ids."""
    return [r.output_ids for r in eng.generate(prompts, params)]


def penalized_on_host(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's formulas, token by token on the host: repetition over prompt and output, then
    frequency * count and presence * (count > 0) over the output."""
    out = logits.double().clone()
    counts = Counter(output)
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, n in counts.items():
        out[t] -= p.frequency_penalty * n + p.presence_penalty
    return out


def check_greedy_against_host(eng: Engine, prompt: list[int], output: list[int], p: SamplingParams) -> None:
    """Each generated token is the argmax of the penalized logits of a dense forward over the prompt
    and the output before it (within rounding of the paged forward)."""
    with torch.inference_mode():
        logits = eng.model.forward_dense(torch.tensor(prompt + output[:-1]))[len(prompt) - 1:].float()
    for i, token in enumerate(output):
        ref = penalized_on_host(logits[i], prompt, output[:i], p)
        assert float(ref[token]) >= float(ref.max()) - 1e-4, (i, token, int(ref.argmax()), output)


PENALIZED = [SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=2.0),
             SamplingParams(max_tokens=20, ignore_eos=True, frequency_penalty=1.5),
             SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.8),
             SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=-0.5, frequency_penalty=0.7,
                            repetition_penalty=0.6)]


# -- in process -----------------------------------------------------------------------------------------
def test_greedy_with_penalties_equals_a_host_reference_under_chained_decode():
    """Chunked prefill, decode chained on the device (each step's penalty counts the token still in
    flight), then again over the cached prefixes."""
    eng = make_engine(max_prefill_tokens=4)
    for _ in range(2):
        outputs = run(eng, PROMPTS, PENALIZED)
        for prompt, output, p in zip(PROMPTS, outputs, PENALIZED):
            assert len(output) == p.max_tokens
            check_greedy_against_host(eng, prompt, output, p)
    assert eng.stats["chained_steps"] > 0
    eng.check_integrity()


def test_a_large_presence_penalty_never_repeats_a_token_under_chained_decode():
    """The in-flight token counts: missing it, a chained step sees the token before it as unseen
    and repeats it. Equal to an engine that never chains."""
    p = SamplingParams(max_tokens=40, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0)
    prompts = PROMPTS + [[66] * 6, [147] * 6, [156] * 6, [246] * 6]
    chained = make_engine()
    outputs = run(chained, prompts, [p] * len(prompts))
    assert chained.stats["chained_steps"] > 0
    plain = run(make_engine(), prompts, [SamplingParams(max_tokens=40, ignore_eos=True)] * len(prompts))
    # (without the penalty this model repeats itself, also its token just before)
    assert any(a == b for o in plain for a, b in zip(o, o[1:]))
    for output in outputs:
        assert len(set(output)) == len(output), output
    unchained = make_engine(overlap_schedule=False)
    assert run(unchained, prompts, [p] * len(prompts)) == outputs
    assert unchained.stats["chained_steps"] == 0


def test_rows_that_do_not_ask_get_the_same_tokens_and_nothing_runs_when_nobody_asks():
    eng = make_engine()
    batches = []
    launch = eng.runner.launch

    def recording_launch(batch, chain=None):  # (the real launch: its batches are kept to look at)
        batches.append(batch)
        return launch(batch, chain=chain)
    eng.runner.launch = recording_launch
    plain = [SamplingParams(max_tokens=10, ignore_eos=True),
             SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=3),
             SamplingParams(max_tokens=10, ignore_eos=True),
             SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.3, top_p=0.8, seed=4)]
    alone = run(eng, PROMPTS, plain)
    assert batches and all(b.penalties is None for b in batches)  # nobody asked: no penalty inputs
    # the neutral values are "not asked" too
    neutral = [SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=0.0, frequency_penalty=0,
                              repetition_penalty=1.0)] * len(PROMPTS)
    batches.clear()
    assert run(eng, PROMPTS, neutral) == run(make_engine(), PROMPTS, plain[:1] * len(PROMPTS))
    assert batches and all(b.penalties is None for b in batches)
    asking = [SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=2.0), plain[1],
              SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=3.0),
              plain[3]]
    batches.clear()
    mixed = run(eng, PROMPTS, asking)
    assert any(b.penalties is not None for b in batches)
    assert mixed[1] == alone[1] and mixed[3] == alone[3]
    for i in (0, 2):
        check_greedy_against_host(eng, PROMPTS[i], mixed[i], asking[i])
    assert eng.stats["chained_steps"] > 0
    eng.check_integrity()


def test_a_large_frequency_penalty_reduces_repeats():
    eng = make_engine()
    prompts = [[t % 7 + 20 for t in range(30)], [3] * 12, PROMPTS[1]]

    def repeats(outputs):
        return sum(len(o) - len(set(o)) for o in outputs)
    free = run(eng, prompts, [SamplingParams(max_tokens=48, ignore_eos=True)] * 3)
    penalized = run(eng, prompts, [SamplingParams(max_tokens=48, ignore_eos=True, frequency_penalty=2.0)] * 3)
    assert repeats(penalized) < repeats(free)
    sampled = [SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.7, seed=s) for s in (1, 2, 3)]
    free = run(eng, prompts, sampled)
    penalized = run(eng, prompts, [SamplingParams(**{**s.__dict__, "frequency_penalty": 2.0}) for s in sampled])
    assert repeats(penalized) < repeats(free)


def test_a_seeded_sampled_request_with_penalties_is_alike_chained_or_not():
    p = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7,
                       presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3)
    chained = make_engine()
    got = run(chained, PROMPTS, [p] * len(PROMPTS))
    assert chained.stats["chained_steps"] > 0
    assert run(make_engine(overlap_schedule=False), PROMPTS, [p] * len(PROMPTS)) == got


def test_logprobs_stay_those_of_the_raw_logits():
    eng = make_engine()
    p = SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=2.0, repetition_penalty=2.0, logprobs=1)
    prompt = PROMPTS[1]  # (greedy repeats itself after it)
    [result] = eng.generate([prompt], p)
    output = result.output_ids
    check_greedy_against_host(eng, prompt, output, p)
    with torch.inference_mode():
        raw = torch.log_softmax(eng.model.forward_dense(torch.tensor(prompt + output[:-1]))[
            len(prompt) - 1:].float(), dim=-1)
    for i, (lp, token) in enumerate(zip(result.logprobs, output)):
        assert math.isclose(lp.logprob, float(raw[i, token]), abs_tol=1e-4)
        assert lp.top[0][0] == int(raw[i].argmax())  # the raw likeliest, whatever the penalty picked
    assert any(lp.top[0][0] != token for lp, token in zip(result.logprobs, output))


BAD_PARAMS = [("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", "1"),
              ("presence_penalty", True), ("presence_penalty", float("nan")), ("frequency_penalty", 3),
              ("frequency_penalty", None), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
              ("repetition_penalty", 10.5), ("repetition_penalty", float("inf"))]


@pytest.mark.parametrize("name,value", BAD_PARAMS, ids=[f"{n}={v!r}" for n, v in BAD_PARAMS])
def test_bad_penalties_are_request_errors_naming_the_field(name, value):
    with pytest.raises(RequestError) as err:
        SamplingParams(**{name: value}).validate(16)
    assert err.value.param == name and name in str(err.value)


def test_penalties_at_their_bounds_are_valid():
    for kw in ({"presence_penalty": 2}, {"presence_penalty": -2.0}, {"frequency_penalty": -2},
               {"repetition_penalty": 10}, {"repetition_penalty": 0.01}):
        SamplingParams(**kw).validate(16)
        assert SamplingParams(**kw).penalized
    assert not SamplingParams(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1).penalized


# -- HTTP -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16)) as s:
        yield s


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("fields", [{"presence_penalty": 2.0}, {"frequency_penalty": 1.5},
                                    {"repetition_penalty": 1.8},
                                    {"presence_penalty": -1, "frequency_penalty": 1, "repetition_penalty": 0.5}])
def test_completions_take_the_penalties(srv, fields):
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True, **fields}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    p = SamplingParams(max_tokens=12, ignore_eos=True, **{k: float(v) for k, v in fields.items()})
    check_greedy_against_host(srv.engine, PROMPTS[0], ids, p)
    neutral = httpx.post(srv.url + "/v1/completions", json={
        **body, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1}, timeout=60)
    plain = httpx.post(srv.url + "/v1/completions", json={k: v for k, v in body.items() if k not in fields},
                       timeout=60)
    assert neutral.status_code == plain.status_code == 200
    assert neutral.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]


BAD_HTTP = [(chat, field, value, code) for chat in (False, True) for field, value, code in [
    ("presence_penalty", 2.5, "invalid_value"), ("presence_penalty", -3, "invalid_value"),
    ("frequency_penalty", 2.0001, "invalid_value"), ("repetition_penalty", 0, "invalid_value"),
    ("repetition_penalty", 11, "invalid_value"), ("presence_penalty", "1", "invalid_type"),
    ("frequency_penalty", True, "invalid_type"), ("repetition_penalty", [1.2], "invalid_type")]]


@pytest.mark.parametrize("chat,field,value,code", BAD_HTTP,
                         ids=[f"{'chat' if c else 'cmpl'}-{f}={json.dumps(v)}" for c, f, v, _ in BAD_HTTP])
def test_bad_penalties_are_400s_naming_the_field(srv, chat, field, value, code):
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": [5, 6]})
    r = httpx.post(srv.url + path, json={**base, "max_tokens": 2, field: value}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == code, err


def test_chat_takes_the_penalties(srv):
    body = {"messages": HI, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    penalized = httpx.post(srv.url + "/v1/chat/completions", json={
        **body, "presence_penalty": 2, "frequency_penalty": 1.0, "repetition_penalty": 1.5}, timeout=60)
    assert penalized.status_code == 200, penalized.text
    ids = penalized.json()["choices"][0]["token_ids"]
    prompt = srv.app.state.hc.tokenizer.apply_chat_template(HI)
    p = SamplingParams(max_tokens=10, presence_penalty=2.0, frequency_penalty=1.0, repetition_penalty=1.5)
    check_greedy_against_host(srv.engine, prompt, ids, p)
    neutral = httpx.post(srv.url + "/v1/chat/completions", json={
        **body, "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1.0}, timeout=60)
    plain = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert neutral.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]


def test_a_simulated_engine_refuses_penalties():
    eng = Engine(EngineConfig(model="tiny", simulate=True, page_size=4, num_pages=64))
    with pytest.raises(RequestError) as err:
        eng.validate([1, 2, 3], SamplingParams(repetition_penalty=1.2))
    assert err.value.param == "repetition_penalty"
    eng.validate([1, 2, 3], SamplingParams(presence_penalty=0.0, repetition_penalty=1.0))

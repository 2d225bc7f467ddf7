"""OpenAI's `logit_bias` (SamplingParams.logit_bias; the API's field, token ids as strings to a bias in
[-100, 100]), served as vLLM V1 serves it: added to the logits before the penalties, temperature and
top-p; logprobs stay the raw logits'. It was a 400 'unsupported_value' at any value but {} and null.
In process on the CPU (tiny preset, decode chained on the device) against a host reference, then over
HTTP (completions, chat, streamed, n choices)."""
from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import LOGIT_BIAS_MAX_TOKENS, RequestError, SamplingParams
from test_n_choices import _stream
from test_penalties import PROMPTS, make_engine, penalized_on_host, run, srv  # noqa: F401  (srv: the fixture)

VOCAB = 512  # the tiny preset's


def greedy(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def check_against_host(eng: Engine, prompt: list[int], output: list[int], p: SamplingParams) -> None:
    """Each token is the argmax of a dense forward's logits with the bias added, then the penalties."""
    with torch.inference_mode():
        logits = eng.model.forward_dense(torch.tensor(prompt + output[:-1]))[len(prompt) - 1:].float()
    for i, token in enumerate(output):
        biased = logits[i].clone()
        for t, v in (p.logit_bias or {}).items():
            biased[t] += v
        ref = penalized_on_host(biased, prompt, output[:i], p)
        assert float(ref[token]) >= float(ref.max()) - 1e-4, (i, token, int(ref.argmax()), output)


def unseen_token(outputs: list[list[int]]) -> int:
    return next(t for t in range(300, VOCAB) if all(t not in o for o in outputs))


# -- in process -----------------------------------------------------------------------------------------
def test_minus_100_bans_the_greedy_token_and_plus_100_forces_one():
    eng = make_engine()
    plain = run(eng, PROMPTS, [greedy()] * len(PROMPTS))
    banned = run(eng, PROMPTS, [greedy(logit_bias={o[0]: -100.0}) for o in plain])
    for o, b, prompt in zip(plain, banned, PROMPTS):
        assert b[0] != o[0] and o[0] not in b, (o, b)  # banned at every step
        check_against_host(eng, prompt, b, greedy(logit_bias={o[0]: -100.0}))
    forced = unseen_token(plain)
    assert run(eng, PROMPTS, [greedy(logit_bias={forced: 100, 7: -3.5})] * 4) == [[forced] * 8] * 4
    assert eng.stats["chained_steps"] > 0
    eng.check_integrity()


def test_a_request_without_it_is_unchanged_and_a_mixed_batch_biases_only_its_row():
    eng = make_engine()
    plain = run(eng, PROMPTS, [greedy()] * 4)
    assert run(eng, PROMPTS, [greedy(logit_bias={})] * 4) == plain  # {}: no bias
    assert not greedy(logit_bias={}).adjusts_logits and greedy(logit_bias={1: 0.5}).adjusts_logits
    mixed = [greedy(), greedy(logit_bias={plain[1][0]: -100.0}), greedy(),
             greedy(temperature=0.9, seed=5, logit_bias={unseen_token(plain): 100.0})]
    got = run(eng, PROMPTS, mixed)
    assert got[0] == plain[0] and got[2] == plain[2]
    assert got[1][0] != plain[1][0] and got[3] == [unseen_token(plain)] * 8  # (sampled: 100 leaves no choice)


def test_combined_with_penalties_the_bias_comes_first():
    eng = make_engine(max_prefill_tokens=4)  # chunked prefill too
    plain = run(eng, PROMPTS, [greedy(16)] * 4)
    params = [greedy(16, logit_bias={plain[0][0]: 1.5, plain[0][1]: -0.7}, repetition_penalty=1.8),
              greedy(16, logit_bias={plain[1][0]: 2.0}, frequency_penalty=1.5, presence_penalty=0.5),
              greedy(16, logit_bias={t: 0.8 for t in plain[2]}, presence_penalty=-0.5, frequency_penalty=0.7,
                     repetition_penalty=0.6),
              greedy(16, presence_penalty=2.0)]
    for _ in range(2):  # the second time over the cached prefixes
        outputs = run(eng, PROMPTS, params)
        for prompt, output, p in zip(PROMPTS, outputs, params):
            check_against_host(eng, prompt, output, p)
    # a bias the penalties outweigh once its token repeats: the token first, then others
    forced, p = unseen_token(plain), greedy(16, logit_bias={unseen_token(plain): 8.0}, frequency_penalty=2.0)
    [out] = run(eng, [PROMPTS[0]], [p])
    assert out[0] == forced and 1 < out.count(forced) < 16, out
    check_against_host(eng, PROMPTS[0], out, p)
    eng.check_integrity()


def test_logprobs_stay_those_of_the_raw_logits():
    eng = make_engine()
    forced = unseen_token(run(eng, PROMPTS[:1], [greedy()]))
    [result] = eng.generate([PROMPTS[0]], greedy(logit_bias={forced: 100.0}, logprobs=1))
    assert result.output_ids == [forced] * 8
    with torch.inference_mode():
        raw = torch.log_softmax(eng.model.forward_dense(torch.tensor(PROMPTS[0] + result.output_ids[:-1]))[
            len(PROMPTS[0]) - 1:].float(), dim=-1)
    for i, lp in enumerate(result.logprobs):
        assert math.isclose(lp.logprob, float(raw[i, forced]), abs_tol=1e-4)
        assert lp.top[0][0] == int(raw[i].argmax()) != forced


BAD = [{"5": 1.0}, {-1: 1.0}, {VOCAB: 1.0}, {True: 1.0}, {5.0: 1.0}, {5: 100.5}, {5: -101}, {5: float("nan")},
       {5: float("inf")}, {5: "1"}, {5: None}, {5: True}, [(5, 1.0)],
       {i: 1.0 for i in range(LOGIT_BIAS_MAX_TOKENS + 1)}]


@pytest.mark.parametrize("bias", BAD, ids=[repr(b)[:40] for b in BAD])
def test_a_bad_logit_bias_is_a_request_error_naming_the_field(bias):
    eng = make_engine()
    with pytest.raises(RequestError) as err:
        eng.validate([1, 2, 3], SamplingParams(logit_bias=bias))
    assert err.value.param == "logit_bias" and "logit_bias" in str(err.value)


def test_a_logit_bias_at_its_bounds_is_valid():
    eng = make_engine()
    for bias in ({0: -100, VOCAB - 1: 100.0}, {i: 0.5 for i in range(VOCAB)}, {}, None):
        eng.validate([1, 2, 3], SamplingParams(logit_bias=bias))
    SamplingParams(logit_bias={i: 0.5 for i in range(LOGIT_BIAS_MAX_TOKENS)}).validate(16, 1 << 17)


def test_a_simulated_engine_refuses_it():
    eng = Engine(EngineConfig(model="tiny", simulate=True, page_size=4, num_pages=64))
    with pytest.raises(RequestError) as err:
        eng.validate([1, 2, 3], SamplingParams(logit_bias={5: 1.0}))
    assert err.value.param == "logit_bias" and "simulate" in str(err.value)
    eng.validate([1, 2, 3], SamplingParams(logit_bias={}))


# -- HTTP -----------------------------------------------------------------------------------------------
HI = [{"role": "user", "content": "hi"}]
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _post(srv, chat: bool, body: dict) -> httpx.Response:
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": PROMPTS[0]})
    return httpx.post(srv.url + path, json={**base, **GREEDY, **body}, timeout=60)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_api_bans_and_forces_tokens(srv, chat):
    plain = _post(srv, chat, {})
    assert plain.status_code == 200, plain.text
    ids = plain.json()["choices"][0]["token_ids"]
    assert _post(srv, chat, {"logit_bias": {}}).json()["choices"][0]["token_ids"] == ids
    banned = _post(srv, chat, {"logit_bias": {str(ids[0]): -100}})
    assert banned.status_code == 200, banned.text
    assert ids[0] not in banned.json()["choices"][0]["token_ids"]
    forced = unseen_token([ids])
    r = _post(srv, chat, {"logit_bias": {str(forced): 100, str(ids[0]): -2.5}, "presence_penalty": 0.5})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [forced] * 6


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streams_and_n_choices_carry_it(srv, chat):
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": PROMPTS[1]})
    forced = unseen_token([])
    body = {**base, **GREEDY, "temperature": 1.0, "seed": 3, "n": 3, "stream": True,
            "logit_bias": {str(forced): 100}}
    chunks = _stream(srv.url, path, body)
    ids: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            ids.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert ids == {j: [forced] * 6 for j in range(3)}
    whole = httpx.post(srv.url + path, json={**body, "stream": False}, timeout=60)
    assert [c["token_ids"] for c in whole.json()["choices"]] == [[forced] * 6] * 3


BAD_HTTP = [(chat, bias, code) for chat in (False, True) for bias, code in [
    ({"abc": 1}, "invalid_type"), ({"5.0": 1}, "invalid_type"), ({"": 1}, "invalid_type"),
    ({"5": 101}, "invalid_value"), ({"5": -100.01}, "invalid_value"), ({"-1": 1}, "invalid_value"),
    ({str(VOCAB): 1}, "invalid_value"), ({"05": 1}, "invalid_value"), ({"9" * 40: 1}, "invalid_value"),
    ({str(i): 1 for i in range(LOGIT_BIAS_MAX_TOKENS + 1)}, "invalid_value"), ({"5": "1"}, "invalid_type"),
    ({"5": True}, "invalid_type"), ({"5": None}, "invalid_type"), ({"5": [1]}, "invalid_type"),
    ([5], "invalid_type"), ("5", "invalid_type"), (5, "invalid_type")]]


@pytest.mark.parametrize("chat,bias,code", BAD_HTTP,
                         ids=[f"{'chat' if c else 'cmpl'}-{json.dumps(b)[:30]}" for c, b, _ in BAD_HTTP])
def test_a_bad_logit_bias_is_a_400_naming_the_field(srv, chat, bias, code):
    r = _post(srv, chat, {"logit_bias": bias})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    param = "logit_bias.5" if isinstance(bias, dict) and list(bias) == ["5"] else "logit_bias"  # (its token's)
    assert err["param"] == param and err["code"] == code, err


def test_a_non_finite_bias_is_a_400(srv):
    """JSON has no NaN, but Python's json reads one; this server's body parser refuses it naming where it is (since
    session 51: the bias of token 5; the field alone before)."""
    for value in ("NaN", "Infinity"):
        body = '{"prompt": [5, 6], "max_tokens": 2, "logit_bias": {"5": %s}}' % value
        r = httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "logit_bias.5"


# -- review fixes --------------------------------------------------------------------------------------------
def test_the_checked_bias_is_a_copy_the_caller_cannot_change():
    """Regression: validation checked the caller's dict and the device later uploaded whatever it held
    by the request's first step: an id added after the check (outside the vocabulary) reached index_put."""
    bias = {5: 1.0}
    p = greedy(logit_bias=bias)
    p.validate(64, VOCAB)
    bias[VOCAB + 7] = 1.0
    assert p.logit_bias == {5: 1.0}
    eng = make_engine()
    assert run(eng, PROMPTS[:1], [p]) == run(eng, PROMPTS[:1], [greedy(logit_bias={5: 1.0})])
    eng.check_integrity()


@pytest.mark.asyncio
async def test_a_finished_request_lets_go_of_its_device_state():
    """Regression: a penalized or biased request kept its [V] counts on the device until the caller
    dropped the Request (the server: until the response ended)."""
    eng = make_engine()
    await eng.start()
    reqs = [eng.add_request(PROMPTS[0], greedy(logit_bias={5: 2.0})),
            eng.add_request(PROMPTS[1], greedy(frequency_penalty=0.5, repetition_penalty=1.2))]
    while not all(r.state.done for r in reqs):
        await asyncio.sleep(0.01)
    assert [r.finish_reason for r in reqs] == ["length"] * 2 and [r.penalty_state for r in reqs] == [None, None]
    eng.check_integrity()
    await eng.shutdown()

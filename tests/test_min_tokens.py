"""vLLM's `min_tokens` (SamplingParams.min_tokens; the API's extra field of that name, default 0): no stop
condition but max_tokens ends a request before it has generated min_tokens tokens. On the device its stop
ids (stop_token_ids, and the EOS ids unless ignore_eos) are masked to -inf while the token a step samples
is one of its first min_tokens (scheduler/penalty_state.py); on the host a stop string only matches once
the text of a later token completes it (scheduler/stop_strings.py, vLLM V1's rule). In process on the CPU
(tiny preset, decode chained on the device, where a step's token index is the host's count plus the
token in flight) against a host reference, then over HTTP (stop strings, stop ids, n, streaming, 400s)."""
from __future__ import annotations

import dataclasses
import json
import random

import httpx
import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams
from scheduler.stop_strings import CompletionText, StopMatcher
from scheduler.tokenizer import ByteTokenizer
from server_fixtures import byte_level_server, tiny_config
from test_n_choices import _stream
from test_penalties import PROMPTS, make_engine

EARLY = [107] * 6  # the tiny model's greedy output starts with 330 and has it again later
TOK = ByteTokenizer(512)


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)


def check_against_host(eng: Engine, prompt: list[int], output: list[int], p: SamplingParams,
                       masked: tuple[int, ...]) -> None:
    """Each token is the argmax of a dense forward's logits with the bias added and, while fewer than
    min_tokens tokens came before it, `masked` at -inf."""
    with torch.inference_mode():
        logits = eng.model.forward_dense(torch.tensor(prompt + output[:-1]))[len(prompt) - 1:].float()
    for i, token in enumerate(output):
        ref = logits[i].clone()
        for t, v in (p.logit_bias or {}).items():
            ref[t] += v
        if i < p.min_tokens:
            ref[list(masked)] = float("-inf")
        assert float(ref[token]) >= float(ref.max()) - 1e-4, (i, token, int(ref.argmax()), output)


# -- on the device -------------------------------------------------------------------------------------------
def test_a_stop_token_the_greedy_run_emits_early_waits_for_min_tokens():
    eng = make_engine()
    [plain] = eng.generate([EARLY], greedy(24))
    stop = plain.output_ids[0]  # (330, which it goes back to later)
    assert stop in plain.output_ids[1:]
    [stopped] = eng.generate([EARLY], greedy(24, stop_token_ids=(stop,)))
    assert (stopped.output_ids, stopped.finish_reason) == ([stop], "stop")
    mins = [1, 4, 8, 9, 12]
    params = [greedy(24, stop_token_ids=(stop,), min_tokens=m) for m in mins]
    results = eng.generate([EARLY] * len(mins), params)
    for res, p in zip(results, params):
        out = res.output_ids
        assert stop not in out[:p.min_tokens], (p.min_tokens, out)
        check_against_host(eng, EARLY, out, p, (stop,))
        if res.finish_reason == "stop":
            assert out[-1] == stop and len(out) > p.min_tokens and stop not in out[:-1]
        else:
            assert (res.finish_reason, len(out)) == ("length", 24) and stop not in out
    # the model goes back to it once it may: the request ends there, "stop"
    assert sum(r.finish_reason == "stop" for r in results) >= 2, [r.output_ids for r in results]
    assert eng.stats["chained_steps"] > 0
    eng.check_integrity()


def _forced(eng: Engine, stop: int, mins: list[int], max_tokens: int = 12, **kw):
    """The stop token biased to be the greedy choice at every step it is not masked at."""
    params = [greedy(max_tokens, logit_bias={stop: 100.0}, min_tokens=m, **kw) for m in mins]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(mins))]
    return prompts, params, eng.generate(prompts, params)


@pytest.mark.parametrize("config", [{}, {"overlap_schedule": False}, {"max_prefill_tokens": 4}],
                         ids=["chained", "unchained", "chunked-prefill"])
def test_the_stop_token_comes_exactly_after_min_tokens_chained_or_not(config):
    """A chained step's token index is the host's count plus the token in flight: counting one less, the
    mask held one step too long (the stop came at min_tokens + 1); counting one more, one too short."""
    eng = make_engine(**config)
    stop, mins = 77, list(range(0, 9))
    prompts, params, results = _forced(eng, stop, mins, stop_token_ids=(stop,))
    for prompt, p, res in zip(prompts, params, results):
        out = res.output_ids
        assert (len(out), out[-1], res.finish_reason) == (p.min_tokens + 1, stop, "stop"), (p.min_tokens, out)
        assert stop not in out[:-1]
        check_against_host(eng, prompt, out, p, (stop,))
    if config.get("overlap_schedule", True):
        assert eng.stats["chained_steps"] > 0
    else:
        assert eng.stats["chained_steps"] == 0
    eng.check_integrity()


def test_chained_and_unchained_engines_agree_and_min_tokens_equal_to_max_tokens_never_stops():
    outputs = []
    for config in ({}, {"overlap_schedule": False}):
        eng = make_engine(**config)
        _, _, results = _forced(eng, 77, [3, 6, 10], stop_token_ids=(77, 5))
        _, params, full = _forced(eng, 77, [12, 12], stop_token_ids=(77,))
        for res in full:  # min_tokens == max_tokens: the stop id is masked at every step
            assert len(res.output_ids) == 12 and 77 not in res.output_ids and res.finish_reason == "length"
        outputs.append([r.output_ids for r in results + full])
        eng.check_integrity()
    assert outputs[0] == outputs[1]


def test_eos_waits_for_min_tokens_with_ignore_eos_too():
    eng = make_engine()
    eos = 77
    eng.model_config = dataclasses.replace(eng.model_config, eos_token_id=eos)  # a model with an EOS
    prompts, params, results = _forced(eng, eos, [0, 2, 5, 7])
    for prompt, p, res in zip(prompts, params, results):
        out = res.output_ids
        assert (len(out), out[-1], res.finish_reason) == (p.min_tokens + 1, eos, "stop"), (p.min_tokens, out)
        check_against_host(eng, prompt, out, p, (eos,))
    # ignore_eos: EOS ends nothing, and min_tokens still holds it, as vLLM's holds every stop id (session 53:
    # it was not masked), as it holds stop_token_ids
    _, _, free = _forced(eng, eos, [5], ignore_eos=True)
    out = free[0].output_ids
    assert eos not in out[:5] and out[5:] == [eos] * 7 and free[0].finish_reason == "length"
    _, _, held = _forced(eng, 91, [5], ignore_eos=True, stop_token_ids=(91,))
    assert (len(held[0].output_ids), held[0].output_ids[-1], held[0].finish_reason) == (6, 91, "stop")
    # the greedy run's own EOS: its first token waits, and ends it when it comes again
    eng.model_config = dataclasses.replace(eng.model_config, eos_token_id=330)
    [res] = eng.generate([EARLY], greedy(24, min_tokens=4))
    assert res.finish_reason == "stop" and res.output_ids[-1] == 330 and 330 not in res.output_ids[:-1]
    assert len(res.output_ids) > 4
    check_against_host(eng, EARLY, res.output_ids, greedy(24, min_tokens=4), (330,))
    eng.check_integrity()


def test_a_request_without_it_is_unchanged_and_a_batch_past_it_runs_nothing_extra():
    eng = make_engine()
    batches = []
    launch = eng.runner.launch

    def recording_launch(batch, chain=None):  # (the real launch: its batches are kept to look at)
        batches.append(batch)
        return launch(batch, chain=chain)
    eng.runner.launch = recording_launch
    plain = [r.output_ids for r in eng.generate(PROMPTS, [greedy(10)] * 4)]
    assert batches and all(b.penalties is None for b in batches)
    # 0, or nothing to mask (no stop ids; the tiny model has no EOS): no logits inputs at all
    for p in (greedy(10, min_tokens=0, stop_token_ids=(5,)), greedy(10, min_tokens=4)):
        batches.clear()
        assert [r.output_ids for r in eng.generate(PROMPTS, [p] * 4)] == plain
        assert batches and all(b.penalties is None for b in batches)
    # a mixed batch: the rows that do not ask keep their tokens; once past min_tokens, no inputs
    stop = plain[1][0]
    batches.clear()
    mixed = [greedy(10), greedy(10, stop_token_ids=(stop,), min_tokens=3), greedy(10, temperature=0.8, seed=2),
             greedy(10)]
    got = eng.generate(PROMPTS, mixed)
    assert got[0].output_ids == plain[0] and got[3].output_ids == plain[3]
    assert got[1].output_ids[0] != stop
    check_against_host(eng, PROMPTS[1], got[1].output_ids, mixed[1], (stop,))
    assert batches[0].penalties is not None and batches[-1].penalties is None
    eng.check_integrity()


BAD = [-1, 13, "3", True, 2.0, None, 1 << 70]


@pytest.mark.parametrize("value", BAD, ids=[repr(v) for v in BAD])
def test_a_bad_min_tokens_is_a_request_error_naming_it(value):
    with pytest.raises(RequestError) as err:
        make_engine().validate([1, 2, 3], greedy(12, min_tokens=value))
    assert err.value.param == "min_tokens" and "min_tokens" in str(err.value)


def test_min_tokens_within_max_tokens_is_valid_and_a_simulated_engine_refuses_it():
    for m in (0, 1, 12):
        greedy(12, min_tokens=m).validate(16)
    sim = Engine(EngineConfig(model="tiny", simulate=True, page_size=4, num_pages=64))
    with pytest.raises(RequestError) as err:
        sim.validate([1, 2, 3], greedy(12, min_tokens=2, stop_token_ids=(5,)))
    assert err.value.param == "min_tokens" and "simulate" in str(err.value)
    sim.validate([1, 2, 3], greedy(12, min_tokens=0))


# -- stop strings on the host ----------------------------------------------------------------------------
def test_a_stop_string_matches_once_a_token_past_min_tokens_completes_it():
    def run(stops, text, min_tokens):
        ct, out = CompletionText(TOK, [], stops, min_tokens=min_tokens), []
        for t in TOK.encode(text):  # (ASCII: a token a character)
            out.append(ct.feed(t))
            if ct.stopped:
                return "".join(out), ct.matcher.matched
        return "".join(out) + ct.flush(), None
    assert run(["ab"], "abcab!", 0) == ("", "ab")
    assert run(["ab"], "abcab!", 2) == ("abc", "ab")       # ended in tokens 0-1: not matched
    assert run(["ab"], "xab!", 2) == ("x", "ab")           # completed by token 2: matched, its start earlier
    assert run(["ab"], "xab!", 3) == ("xab!", None)
    assert run(["b", "abc"], "abx", 2) == ("abx", None)    # "b", held inside "ab", ended in token 1
    assert run(["b", "abc"], "abc", 2) == ("", "abc")
    assert run(["b", "abc"], "abcb", 3) == ("abc", "b")


def _reference(pieces: list[str], stops: list[str], min_tokens: int) -> tuple[str, int | None]:
    """vLLM V1's rule: (the text before the leftmost match that the text of a token at index >= min_tokens
    completes, it may start earlier; that token's index), the whole text searched each time."""
    for k in range(min_tokens, len(pieces)):
        before, text = len("".join(pieces[:k])), "".join(pieces[:k + 1])
        hits = [i for s in stops if (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits:
            return text[:min(hits)], k
    return "".join(pieces), None


def test_streamed_pieces_add_up_to_the_reference_wherever_min_tokens_falls():
    rng = random.Random(11)
    for _ in range(3000):
        pieces = ["".join(rng.choice("aabc") for _ in range(rng.randrange(0, 3))) for _ in range(rng.randrange(7))]
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 4))]
        m, min_tokens, out = StopMatcher(stops), rng.randrange(0, 8), []
        for k, piece in enumerate(pieces):
            out.append(m.feed(piece, can_match=k >= min_tokens))
            if m.matched is not None:
                break
        else:
            out.append(m.flush())
        assert "".join(out) == _reference(pieces, stops, min_tokens)[0], (pieces, stops, min_tokens, out)


# -- HTTP -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=32)) as s:
        yield s


HI = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


def _post(srv, chat: bool, body: dict) -> httpx.Response:
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": "hello"})
    return httpx.post(srv.url + path, json={**base, **GREEDY, **body}, timeout=60)


def _text(choice: dict) -> str:
    if "message" in choice:
        return choice["message"]["content"]
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stop_string_before_min_tokens_is_not_matched(srv, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"messages": [{"role": "user", "content": "say it"}]} if chat else {"prompt": "hello"}
    body = {**base, **GREEDY, "max_tokens": 32}
    chunks = _stream(srv.url, path, body)[1 if chat else 0:]  # (a chat's first chunk: its role alone)
    ids = [t for ch in chunks for t in ch["choices"][0]["token_ids"]]
    pieces = [_text(ch["choices"][0]) for ch in chunks]
    assert len(ids) == len(pieces) == 32
    # a character the text holds first in token `first` and again in token `again`: the first occurrence
    # that a token at index >= min_tokens completes ends it
    stop, first, again = next((c, k, j) for k in range(1, 24) for c in pieces[k] if c != "\ufffd"
                              and c not in "".join(pieces[:k]) for j in range(k + 3, 32) if c in pieces[j])
    for min_tokens in (0, first + 1, again):
        want, kept = _reference(pieces, [stop], min_tokens)
        r = httpx.post(srv.url + path, json={**body, "stop": stop, "min_tokens": min_tokens}, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (_text(choice), choice["finish_reason"]) == (want, "stop"), (min_tokens, stop, pieces)
        assert choice["token_ids"] == ids[:kept + 1] and r.json()["usage"]["completion_tokens"] == kept + 1
        streamed = _stream(srv.url, path, {**body, "stop": stop, "min_tokens": min_tokens})
        assert "".join(_text(ch["choices"][0]) for ch in streamed) == want
        assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
    assert _reference(pieces, [stop], 0)[1] <= first < _reference(pieces, [stop], first + 1)[1]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_choices_streamed_or_not_carry_it(srv, chat):
    stop, m = 77, 5
    body = {"max_tokens": 16, "temperature": 1.0, "seed": 3, "n": 3, "stop": [stop], "min_tokens": m,
            "logit_bias": {str(stop): 100}}
    whole = _post(srv, chat, body)
    assert whole.status_code == 200, whole.text
    choices = whole.json()["choices"]
    ends = [(c["token_ids"][-1], len(c["token_ids"]), c["finish_reason"]) for c in choices]
    assert ends == [(stop, m + 1, "stop")] * 3
    assert all(stop not in c["token_ids"][:-1] for c in choices)
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": "hello"})
    ids: dict[int, list[int]] = {}
    finish = {}
    for chunk in _stream(srv.url, path, {**base, **GREEDY, **body}):
        for choice in chunk["choices"]:
            ids.setdefault(choice["index"], []).extend(choice["token_ids"])
            finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
    assert ids == {j: c["token_ids"] for j, c in enumerate(choices)} and finish == {0: "stop", 1: "stop", 2: "stop"}
    srv.engine.check_integrity()


BAD_HTTP = [(chat, body, code) for chat in (False, True) for body, code in [
    ({"min_tokens": -1}, "invalid_value"), ({"min_tokens": "3"}, "invalid_type"),
    ({"min_tokens": True}, "invalid_type"), ({"min_tokens": 2.0}, "invalid_type"),
    ({"min_tokens": [1]}, "invalid_type"), ({"min_tokens": 5, "max_tokens": 4}, "invalid_value")]] + [
    (False, {"min_tokens": 17}, "invalid_value"),  # a completion's max_tokens left out: 16
    (True, {"min_tokens": 33}, "invalid_value"),   # a chat's: what is left of the context, within the limit (32)
    (True, {"min_tokens": 5, "max_completion_tokens": 4}, "invalid_value")]


@pytest.mark.parametrize("chat,body,code", BAD_HTTP,
                         ids=[f"{'chat' if c else 'cmpl'}-{json.dumps(b)}" for c, b, _ in BAD_HTTP])
def test_a_bad_min_tokens_is_a_400_naming_it(srv, chat, body, code):
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": [5, 6]})
    r = httpx.post(srv.url + path, json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "min_tokens" and err["code"] == code, err


@pytest.mark.parametrize("chat,body", [(False, {"min_tokens": 16}), (True, {"min_tokens": 32}),
                                       (False, {"min_tokens": None}), (True, {"min_tokens": 0, "max_tokens": 3})])
def test_min_tokens_up_to_the_effective_max_tokens_is_served(srv, chat, body):
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": [5, 6]})
    r = httpx.post(srv.url + path, json={**base, **GREEDY, **body}, timeout=60)
    assert r.status_code == 200, r.text
    plain = httpx.post(srv.url + path, json={**base, **GREEDY, **{k: v for k, v in body.items() if k != "min_tokens"}},
                       timeout=60)
    assert r.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]

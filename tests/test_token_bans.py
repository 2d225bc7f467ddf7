"""vLLM's `allowed_token_ids` and `bad_words` (SamplingParams.allowed_token_ids / bad_words_token_ids; the
API's fields, bad words as strings the server tokenizes), served as vLLM V1 serves them: every token outside
the allowed ones at -inf; a one-token bad word banned at every step, a longer one's last token banned where
the request's last output tokens are the rest of it. In process on the CPU (tiny preset), greedy, against a
host reference over a dense forward, with decode chained on the device (a bad word's in-flight token is only
there) and without; then over HTTP."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.request import (ALLOWED_TOKEN_IDS_MAX, BAD_WORDS_MAX, BAD_WORDS_MAX_TOKENS, RequestError,
                               SamplingParams)
import test_penalties
from test_penalties import PROMPTS, make_engine, run

srv = test_penalties.srv  # (its server fixture: the tiny engine behind a byte-level tokenizer)

VOCAB = 512  # the tiny preset's


def greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def banned_on_host(p: SamplingParams, output: list[int]) -> set[int]:
    """vLLM's bans before the next token after `output`: every token outside allowed_token_ids, each one-token
    bad word, and each longer bad word's last token where the output ends with the rest of it."""
    banned = set() if p.allowed_token_ids is None else set(range(VOCAB)) - set(p.allowed_token_ids)
    for word in p.bad_words_token_ids:
        if len(word) == 1 or len(output) >= len(word) - 1 and tuple(output[len(output) - len(word) + 1:]) == word[:-1]:
            banned.add(word[-1])
    return banned


def check_against_host(eng: Engine, prompt: list[int], output: list[int], p: SamplingParams) -> None:
    """Each token is the argmax of a dense forward's logits with that step's banned tokens at -inf."""
    with torch.inference_mode():
        logits = eng.model.forward_dense(torch.tensor(prompt + output[:-1]))[len(prompt) - 1:].float()
    for i, token in enumerate(output):
        ref = logits[i].clone()
        ref[sorted(banned_on_host(p, output[:i]))] = float("-inf")
        assert token not in banned_on_host(p, output[:i]), (i, token, output)
        assert float(ref[token]) >= float(ref.max()) - 1e-4, (i, token, int(ref.argmax()), output)


def pairs(ids: list[int]) -> list[tuple[int, int]]:
    return list(zip(ids, ids[1:]))


def repeated_pair(outputs: list[list[int]]) -> tuple[int, tuple[int, int], int]:
    """(prompt index, (a, b), j): a pair of consecutive greedy tokens at output[j], output[j + 1] where `a`
    came before j followed by another token (so a ban of [a, b] must keep that `a`)."""
    for k, out in enumerate(outputs):
        for j, (a, b) in enumerate(pairs(out)):
            if any(out[i] == a and out[i + 1] != b for i in range(j)):
                return k, (a, b), j
    raise AssertionError(f"no such pair in {outputs}")


# -- in process -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain():
    return run(make_engine(), PROMPTS, [greedy()] * len(PROMPTS))


def test_allowed_token_ids_restrict_every_token(plain):
    eng = make_engine()
    allowed = tuple(t for t in range(0, VOCAB, 3) if t != plain[0][0])  # the greedy first token left out
    out = run(eng, PROMPTS, [greedy(allowed_token_ids=allowed)] * 4)
    for prompt, o, p in zip(PROMPTS, out, plain):
        assert set(o) <= set(allowed), o
        check_against_host(eng, prompt, o, greedy(allowed_token_ids=allowed))
    assert out[0] != plain[0]
    assert run(eng, PROMPTS[:1], [greedy(allowed_token_ids=(7,))]) == [[7] * 24]  # one token: no choice
    assert eng.stats["chained_steps"] > 0
    eng.check_integrity()


def test_a_one_token_bad_word_never_appears(plain):
    eng = make_engine()
    words = ((plain[1][0],), (plain[1][3],), (plain[2][0],))
    out = run(eng, PROMPTS, [greedy(bad_words_token_ids=words)] * 4)
    for prompt, o in zip(PROMPTS, out):
        assert not {w[0] for w in words} & set(o), o
        check_against_host(eng, prompt, o, greedy(bad_words_token_ids=words))
    assert out[1] != plain[1] and out[2] != plain[2]


@pytest.mark.parametrize("overlap", [True, False], ids=["chained", "unchained"])
def test_a_two_token_bad_word_bans_its_second_token_only_after_its_first(plain, overlap):
    """vLLM V1 matches past output tokens: under chained decode the first token of the pair is still in
    flight on the device when the step that must ban the second is enqueued."""
    k, (a, b), j = repeated_pair(plain)
    eng = make_engine(overlap_schedule=overlap)
    p = greedy(bad_words_token_ids=((a, b),))
    [out] = run(eng, [PROMPTS[k]], [p])
    assert (a, b) not in pairs(out), (a, b, out)
    assert out[:j + 1] == plain[k][:j + 1] and out[j + 1] != b  # `a` alone stays, where it came
    check_against_host(eng, PROMPTS[k], out, p)
    assert (eng.stats["chained_steps"] > 0) == overlap


def test_a_three_token_bad_word(plain):
    k, j = 0, 5
    word = tuple(plain[k][j:j + 3])
    p = greedy(bad_words_token_ids=(word, (plain[k][j + 1], 999 % VOCAB)))
    eng = make_engine()
    [out] = run(eng, [PROMPTS[k]], [p])
    assert out[:j + 2] == plain[k][:j + 2] and out[j + 2] != word[2], (word, out)
    check_against_host(eng, PROMPTS[k], out, p)


def test_a_mixed_batch_restricts_only_its_restricted_rows(plain):
    _, (a, b), _ = repeated_pair(plain)
    eng = make_engine(max_prefill_tokens=4)  # chunked prefill too
    params = [greedy(), greedy(allowed_token_ids=tuple(range(100, 200)), bad_words_token_ids=((150,), (a, b))),
              greedy(), greedy(bad_words_token_ids=((a, b), (plain[3][5],)), temperature=0.9, seed=3)]
    for _ in range(2):  # the second time over the cached prefixes
        out = run(eng, PROMPTS, params)
        for i, (o, p) in enumerate(zip(out, params)):
            if p == greedy():
                assert o == plain[i]
            elif p.greedy:
                check_against_host(eng, PROMPTS[i], o, p)
        assert set(out[1]) <= set(range(100, 200)) - {150} and (a, b) not in pairs(out[1])
        assert (a, b) not in pairs(out[3]) and plain[3][5] not in out[3]
    eng.check_integrity()


def test_chained_and_unchained_decode_agree():
    def outputs(overlap: bool):
        eng = make_engine(overlap_schedule=overlap)
        base = run(eng, PROMPTS, [greedy()] * 4)
        # (row 0's words come in its greedy answer: at steps 5 and 10 at the latest)
        params = [greedy(bad_words_token_ids=((base[0][4], base[0][5]), tuple(base[0][8:11]))),
                  greedy(allowed_token_ids=tuple(range(0, VOCAB, 2)), bad_words_token_ids=tuple(pairs(base[1])[:4])),
                  greedy(bad_words_token_ids=((base[2][0], base[2][1]), (base[2][3],)), temperature=1.0, seed=11),
                  greedy(allowed_token_ids=tuple(base[3]), bad_words_token_ids=tuple(pairs(base[3])[:6]))]
        got = run(eng, PROMPTS, params)
        check_against_host(eng, PROMPTS[0], got[0], params[0])
        eng.check_integrity()
        return base, got, eng.stats["chained_steps"]

    chained, unchained = outputs(True), outputs(False)
    assert chained[:2] == unchained[:2] and chained[2] > 0 == unchained[2]
    (base, got, _) = chained  # (row 0's pair banned at step 5: the comparison compares bans)
    assert got[0][:5] == base[0][:5] and got[0][5] != base[0][5]


def test_beside_a_guided_row_the_deferred_step_bans_as_a_chained_one():
    """A chained step with a guided row samples once the step before it is processed (`Engine._sample`): its
    bad-word rows' bans come from the host's tokens then, and answer as an unchained engine's."""
    def outputs(overlap: bool):
        eng = make_engine(overlap_schedule=overlap)
        base = run(eng, PROMPTS, [greedy()] * 4)
        k, (a, b), _ = repeated_pair(base)
        params = [SamplingParams(max_tokens=20, guided=GuidedSpec("regex", "[a-z ]{5,40}")),
                  greedy(bad_words_token_ids=((a, b), (base[1][0],))), greedy(allowed_token_ids=(3, 4, 5)),
                  greedy(bad_words_token_ids=((a, b),))]
        return run(eng, PROMPTS, params), eng.stats["chained_steps"]

    (chained, steps), (unchained, none) = outputs(True), outputs(False)
    assert chained == unchained and steps > 0 == none
    assert set(chained[2]) <= {3, 4, 5}


def test_min_tokens_never_holds_back_the_only_allowed_tokens():
    """allowed_token_ids within the stop ids min_tokens holds back left nothing to sample (a row of -inf:
    greedy took token 0, outside the allowed ids): the restriction wins, as a grammar does."""
    eng = make_engine()
    [res] = eng.generate([PROMPTS[0]], greedy(8, allowed_token_ids=(77,), stop_token_ids=(77,), min_tokens=3))
    assert set(res.output_ids) == {77}, res.output_ids
    [res] = eng.generate([PROMPTS[0]], greedy(8, allowed_token_ids=(77, 78), stop_token_ids=(77,), min_tokens=3))
    assert res.output_ids[:3] == [78] * 3 and set(res.output_ids) <= {77, 78}


def test_neutral_values_change_nothing(plain):
    eng = make_engine()
    assert run(eng, PROMPTS, [greedy(bad_words_token_ids=())] * 4) == plain
    assert not greedy().restricts_tokens and greedy(allowed_token_ids=(1,)).restricts_tokens
    assert greedy(bad_words_token_ids=((1, 2),)).restricts_tokens


def test_the_checked_fields_are_copies_the_caller_cannot_change():
    allowed, word = [5, 6], [7, 8]
    p = greedy(allowed_token_ids=allowed, bad_words_token_ids=[word])
    p.validate(64, VOCAB)
    allowed.append(VOCAB + 3)
    word.append(VOCAB + 4)
    assert p.allowed_token_ids == (5, 6) and p.bad_words_token_ids == ((7, 8),)
    hash(p)  # (tuples: a frozen SamplingParams stays hashable)


BAD = [("allowed_token_ids", dict(allowed_token_ids=())), ("allowed_token_ids", dict(allowed_token_ids=(-1,))),
       ("allowed_token_ids", dict(allowed_token_ids=(VOCAB,))), ("allowed_token_ids", dict(allowed_token_ids=(True,))),
       ("allowed_token_ids", dict(allowed_token_ids=(5.0,))), ("allowed_token_ids", dict(allowed_token_ids="5")),
       ("allowed_token_ids", dict(allowed_token_ids=tuple(range(ALLOWED_TOKEN_IDS_MAX + 1)))),
       ("bad_words_token_ids", dict(bad_words_token_ids=((),))),
       ("bad_words_token_ids", dict(bad_words_token_ids=((VOCAB,),))),
       ("bad_words_token_ids", dict(bad_words_token_ids=((1, -2),))),
       ("bad_words_token_ids", dict(bad_words_token_ids=(5,))),
       ("bad_words_token_ids", dict(bad_words_token_ids=None)),
       ("bad_words_token_ids", dict(bad_words_token_ids=((True,),))),
       ("bad_words_token_ids", dict(bad_words_token_ids=tuple((i,) for i in range(BAD_WORDS_MAX + 1)))),
       ("bad_words_token_ids", dict(bad_words_token_ids=(tuple(range(BAD_WORDS_MAX_TOKENS + 1)),))),
       ("allowed_token_ids", dict(allowed_token_ids=(5, 6), bad_words_token_ids=((5,), (6,))))]


@pytest.mark.parametrize("param,kw", BAD, ids=[f"{p}-{repr(kw)[:40]}" for p, kw in BAD])
def test_a_bad_value_is_a_request_error_naming_the_field(param, kw):
    eng = make_engine()
    with pytest.raises(RequestError) as err:
        eng.validate([1, 2, 3], SamplingParams(**kw))
    assert err.value.param == param and param in str(err.value), str(err.value)


def test_values_at_their_bounds_are_valid():
    eng = make_engine()
    eng.validate([1, 2, 3], SamplingParams(allowed_token_ids=(0, VOCAB - 1), bad_words_token_ids=((0, VOCAB - 1),)))
    SamplingParams(allowed_token_ids=tuple(range(ALLOWED_TOKEN_IDS_MAX)),
                   bad_words_token_ids=tuple((i, i + 1) for i in range(BAD_WORDS_MAX))).validate(16, 1 << 18)
    SamplingParams(bad_words_token_ids=(tuple(range(BAD_WORDS_MAX_TOKENS)),)).validate(16, 1 << 17)


def test_a_simulated_engine_refuses_them():
    eng = Engine(EngineConfig(model="tiny", simulate=True, page_size=4, num_pages=64))
    for kw, param in ((dict(allowed_token_ids=(5,)), "allowed_token_ids"),
                      (dict(bad_words_token_ids=((5, 6),)), "bad_words_token_ids")):
        with pytest.raises(RequestError) as err:
            eng.validate([1, 2, 3], SamplingParams(**kw))
        assert err.value.param == param and "simulate" in str(err.value)


# -- HTTP -----------------------------------------------------------------------------------------------
HI = [{"role": "user", "content": "hi"}]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _post(srv, chat: bool, body: dict) -> httpx.Response:
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": PROMPTS[0]})
    # (the body's JSON as ASCII: a lone surrogate is sent as its escape, which a client's UTF-8 cannot carry)
    return httpx.post(srv.url + path, content=json.dumps({**base, **GREEDY, **body}),
                      headers={"content-type": "application/json"}, timeout=60)


def _ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _word_of(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A generated token that is a whole word of the tokenizer's: (its text, its id)."""
    for t in ids:
        text = tokenizer.decode([t])
        if text and text.strip() == text and text.isprintable() and tokenizer.encode(text, False) == [t]:
            return text, t
    raise AssertionError(f"no token of {ids} is a word")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_api_takes_allowed_token_ids_and_bad_words(srv, chat):
    plain = _ids(_post(srv, chat, {}))
    allowed = [t for t in range(0, VOCAB, 5) if t != plain[0]]
    got = _ids(_post(srv, chat, {"allowed_token_ids": allowed}))
    assert set(got) <= set(allowed) and got != plain
    tokenizer = srv.app.state.hc.tokenizer
    word, token = _word_of(tokenizer, plain)
    got = _ids(_post(srv, chat, {"bad_words": [word, " " + word]}))  # (vLLM strips a word's leading blanks)
    assert token not in got and got != plain
    assert _ids(_post(srv, chat, {"bad_words": [], "allowed_token_ids": None})) == plain


def test_the_api_tokenizes_a_bad_word_as_vllm_does():
    """Each word (its leading blanks stripped) as is, and with a leading space where that tokenizes to as many
    tokens with another first one; add_special_tokens off."""
    from scheduler.ban_fields import bad_words_token_ids

    class Words:  # " x" is one token where the word is a whole word
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return {"cat": [1], " cat": [2], "a b": [3, 4], " a b": [5, 6, 7], "dog": [8], " dog": [8]}[text]

    assert bad_words_token_ids(["cat", "  a b", "dog"], Words(), VOCAB) == ((1,), (2,), (3, 4), (8,))


BAD_HTTP = [(chat, field, value, code) for chat in (False, True) for field, value, code in [
    ("allowed_token_ids", [], "invalid_value"), ("allowed_token_ids", [-1], "invalid_value"),
    ("allowed_token_ids", [VOCAB], "invalid_value"), ("allowed_token_ids", [True], "invalid_type"),
    ("allowed_token_ids", [1.5], "invalid_type"), ("allowed_token_ids", "5", "invalid_type"),
    ("allowed_token_ids", 5, "invalid_type"), ("allowed_token_ids", list(range(ALLOWED_TOKEN_IDS_MAX + 1)),
                                               "invalid_value"),
    ("bad_words", "cat", "invalid_type"), ("bad_words", [5], "invalid_type"), ("bad_words", [""], "invalid_value"),
    ("bad_words", ["   "], "invalid_value"), ("bad_words", ["\ud800"], "invalid_value"),
    ("bad_words", [f"w{i}" for i in range(BAD_WORDS_MAX + 1)], "invalid_value"),
    ("bad_words", ["x" * (BAD_WORDS_MAX_TOKENS + 1)], "invalid_value")]]


@pytest.mark.parametrize("chat,field,value,code", BAD_HTTP,
                         ids=[f"{'chat' if c else 'cmpl'}-{f}-{repr(v)[:20]}" for c, f, v, _ in BAD_HTTP])
def test_a_bad_value_is_a_400_naming_the_field(srv, chat, field, value, code):
    r = _post(srv, chat, {field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] in (field, f"{field}.0") and err["code"] == code, err  # (a bad item: its path)

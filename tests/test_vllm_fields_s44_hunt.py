"""Hunt (session 44): vLLM's `return_tokens_as_token_ids` and `truncate_prompt_tokens` combined with `echo`,
`logprobs`, n > 1, batched prompts, chats, token-id prompts, streams and the prefix cache (scheduler/
prompt_truncation.py, scheduler/logprobs.py, scheduler/choices.py). The server of test_api_vllm_fields (the tiny
model on the CPU, a byte-level tokenizer: one token per byte of ASCII text, ids past 255 decode to nothing), and
one whose "<s>" is a special token. Regressions: a truncated text prompt's echo dropped the special tokens written
in it; a special token's chat `bytes` with return_tokens_as_token_ids were [] (vLLM's: its text).

Logprobs are compared within 1e-4: a request batched with another (n > 1) or computed on a cached prefix gets
the same tokens but float sums in another order."""
from __future__ import annotations

import math

import pytest
import test_api_vllm_fields
from test_api_vllm_fields import HI, TEXT, TOKEN_ID, ok, post, sse
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer

COMPLETION_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
SPECIAL = 256  # special_srv's "<s>"
srv = test_api_vllm_fields.srv  # (the fixture: its server)


@pytest.fixture(scope="module")
def special_srv(tmp_path_factory):
    """A byte-level tokenizer with a special token, "<s>" (id SPECIAL), and a chat template."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), special=("<s>",), config={"chat_template": template})
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=HFTokenizer(str(path)))) as s:
        yield s


def close(a, b, path="") -> None:
    """a == b, floats within 1e-4 (a dict's keys and a list's length exactly)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{path}: {sorted(a)} != {sorted(b)}"
        for k in a:
            close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: {len(a)} != {len(b)}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, abs_tol=1e-4), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def streamed(chunks: list[dict], chat: bool = False) -> dict[int, dict]:
    """Per choice index, its chunks added up: text, token ids, logprobs (a completion's columns, a chat's content)."""
    out: dict[int, dict] = {}
    for c in chunks:
        for ch in c["choices"]:
            d = out.setdefault(ch["index"], {"text": "", "token_ids": [], "logprobs": {"content": []} if chat else
                                             {k: [] for k in COMPLETION_KEYS}})
            d["text"] += (ch["delta"].get("content") or "") if chat else ch["text"]
            d["token_ids"] += ch.get("token_ids") or []
            for k, v in (ch["logprobs"] or {}).items():
                d["logprobs"][k] += v
    return out


def choices(r: dict, chat: bool = False) -> dict[int, dict]:
    return {c["index"]: {"text": c["message"]["content"] if chat else c["text"], "token_ids": c["token_ids"],
                         "logprobs": c["logprobs"]} for c in r["choices"]}


def pieces(srv, ids: list[int], as_ids: bool = False) -> list[str]:
    return [f"token_id:{t}" if as_ids else (srv.tok.decode([t]) or f"token_id:{t}") for t in ids]


# -- truncate_prompt_tokens with echo and logprobs -------------------------------------------------------------
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_a_truncated_echo_lines_up_with_the_kept_prompts_logprobs(srv, as_ids, stream):
    """The echoed prompt's entries are the kept prompt's (its first null, the rest given the kept tokens before
    them), as the kept prompt sent alone gets them; its text is the kept tokens'."""
    ids = srv.tok.encode(TEXT)
    base = {"max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    body = {**base, "prompt": ids if as_ids else TEXT, "truncate_prompt_tokens": 6}
    cut = streamed(sse(srv, "/v1/completions", body))[0] if stream else choices(ok(srv, "/v1/completions", body))[0]
    alone = choices(ok(srv, "/v1/completions", {**base, "prompt": ids[-6:]}))[0]
    close(cut, alone)
    lp = cut["logprobs"]
    assert lp["tokens"] == pieces(srv, ids[-6:] + cut["token_ids"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert None not in lp["token_logprobs"][1:] and cut["text"].startswith(TEXT[-6:])
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]


@pytest.mark.parametrize("as_token_ids", [False, True], ids=["pieces", "token-ids"])
def test_n_truncated_echoed_choices_agree_streamed_or_not(srv, as_token_ids):
    body = {"prompt": TEXT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2, "n": 2,
            "truncate_prompt_tokens": 6, "return_tokens_as_token_ids": as_token_ids}
    whole = choices(ok(srv, "/v1/completions", body))
    assert sorted(whole) == [0, 1]
    close(streamed(sse(srv, "/v1/completions", body)), whole)
    close(whole[0], whole[1])  # (greedy: both choices are the one answer)
    kept = srv.tok.encode(TEXT)[-6:]
    assert whole[0]["logprobs"]["tokens"] == pieces(srv, kept + whole[0]["token_ids"], as_token_ids)


def test_a_truncated_batch_echoes_each_kept_prompt(srv):
    """Each prompt of a batch is cut on its own (one shorter than k kept whole), its choices (n = 2, index
    p * n + j) echoing its kept tokens with their logprobs, as that prompt alone gets them; a stream agrees."""
    ids = srv.tok.encode(TEXT)
    prompts = [ids, ids[:2], ids[4:12]]
    base = {"max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    body = {**base, "prompt": prompts, "truncate_prompt_tokens": 3, "n": 2}
    r = ok(srv, "/v1/completions", body)
    assert r["usage"]["prompt_tokens"] == 3 + 2 + 3
    whole = choices(r)
    assert sorted(whole) == list(range(6))
    close(streamed(sse(srv, "/v1/completions", body)), whole)
    for p, prompt in enumerate(prompts):
        alone = choices(ok(srv, "/v1/completions", {**base, "prompt": prompt[-3:]}))[0]
        for j in range(2):
            close(whole[p * 2 + j], alone)
            assert whole[p * 2 + j]["logprobs"]["tokens"][:len(prompt[-3:])] == pieces(srv, prompt[-3:])


@pytest.mark.parametrize("max_tokens", [0, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_a_one_token_truncation_echoes_its_token_with_a_null_logprob(srv, max_tokens, stream):
    """k = 1 leaves a prompt of one token: no prompt row has a logprob to give (the engine asks none), its one
    entry is the null one."""
    body = {"prompt": TEXT, "max_tokens": max_tokens, "echo": True, "logprobs": 1, "truncate_prompt_tokens": 1}
    c = streamed(sse(srv, "/v1/completions", body))[0] if stream else choices(ok(srv, "/v1/completions", body))[0]
    lp = c["logprobs"]
    assert lp["tokens"][0] == TEXT[-1] and c["text"].startswith(TEXT[-1])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == 1 + max_tokens and None not in lp["token_logprobs"][1:]


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_a_truncated_text_prompt_echoes_its_special_tokens(special_srv, stream):
    """A text prompt's echo is its text: cut by truncate_prompt_tokens, the kept part of it, with the special
    tokens the client wrote in it (as the whole prompt's echo has them; vLLM echoes the whole text). Regression:
    the kept ids were decoded as a choice's text is, skipping special tokens: "a<s>bc<s>de" cut to 6 echoed
    "bcde" (a token-id prompt's echo is still decoded as the choice's text: test_s41_features_hunt)."""
    prompt = "a<s>bc<s>de"
    assert ok(special_srv, "/tokenize", {"prompt": prompt})["tokens"][1] == SPECIAL
    x = ok(special_srv, "/tokenize", {"prompt": "x"})["tokens"][0]
    body = {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 0, "truncate_prompt_tokens": 6,
            "logit_bias": {str(x): 100}}  # (the answer: "xx")
    c = streamed(sse(special_srv, "/v1/completions", body))[0] if stream else \
        choices(ok(special_srv, "/v1/completions", body))[0]
    assert c["text"] == "<s>bc<s>dexx"
    assert c["logprobs"]["tokens"][:6] == [f"token_id:{SPECIAL}", "b", "c", f"token_id:{SPECIAL}", "d", "e"]
    whole = choices(ok(special_srv, "/v1/completions", {**body, "truncate_prompt_tokens": 7}))[0]
    assert whole["text"] == prompt + "xx"


def test_minus_one_echoes_the_longest_kept_prompt_with_every_logprob(srv):
    context = srv.engine.max_kv_tokens
    long_ids = [ord("a") + i % 26 for i in range(context + 20)]
    body = {"prompt": long_ids, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0,
            "truncate_prompt_tokens": -1, "return_tokens_as_token_ids": True}
    r = ok(srv, "/v1/completions", body)
    kept = context - 2
    assert r["usage"]["prompt_tokens"] == kept
    c = r["choices"][0]
    lp = c["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in long_ids[-kept:] + c["token_ids"]]
    assert lp["token_logprobs"].count(None) == 1 and lp["token_logprobs"][0] is None
    assert all(list(top) == [tok] for tok, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))  # (logprobs 0)


# -- the prefix cache under a truncated prompt -----------------------------------------------------------------
@pytest.mark.parametrize("echo", [False, True], ids=["plain", "echo"])
def test_a_cached_truncated_prompt_repeats_its_answer_and_logprobs(srv, echo):
    """The second identical request hits the first's pages (its kept prompt's, not the whole prompt's) unless it
    asks for the prompt's logprobs (every prompt row computed): the same tokens, text and logprobs."""
    body = {"prompt": f"{echo}: {TEXT} and the cat", "max_tokens": 5, "temperature": 0, "logprobs": 3,
            "truncate_prompt_tokens": 13, "echo": echo}
    first = ok(srv, "/v1/completions", body)
    second = ok(srv, "/v1/completions", body)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (0 if echo else 12)
    close(choices(second), choices(first))
    close(streamed(sse(srv, "/v1/completions", body)), choices(first))
    # the whole prompt shares no page with its kept tail (a prefix is matched from the first token)
    whole = ok(srv, "/v1/completions", {**body, "truncate_prompt_tokens": None, "echo": False})
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- return_tokens_as_token_ids --------------------------------------------------------------------------------
def test_token_ids_keep_alternatives_that_decode_alike_apart(srv):
    """As token ids, a top_logprobs dict never merges two alternatives (ids past the tokenizer's, and lone
    bytes of a multi-byte character, decode alike): the k likeliest and the sampled token, k or k + 1 keys."""
    body = {"prompt": TEXT, "max_tokens": 12, "temperature": 1.0, "seed": 7, "logprobs": 5,
            "return_tokens_as_token_ids": True}
    for stream in (False, True):
        c = streamed(sse(srv, "/v1/completions", body))[0] if stream else choices(ok(srv, "/v1/completions", body))[0]
        lp = c["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
            assert tok in top and all(TOKEN_ID.fullmatch(k) for k in top)
            assert len(top) == 5 + (top[tok] < sorted(top.values())[-5])  # (the sampled one outside the 5)


def test_an_echoed_prompts_top_logprobs_as_token_ids(srv):
    """The echoed prompt's alternatives are token ids too, each prompt entry's dict holds its own token, and the
    text offsets run on the "token_id:N" pieces through prompt and answer, streamed or not."""
    ids = srv.tok.encode(TEXT)
    body = {"prompt": TEXT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2,
            "truncate_prompt_tokens": 5, "return_tokens_as_token_ids": True}
    whole = choices(ok(srv, "/v1/completions", body))[0]
    lp = whole["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids[-5:] + whole["token_ids"]]
    assert whole["text"].startswith(TEXT[-5:])  # (the text is text)
    for tok, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]):
        assert tok in top and all(TOKEN_ID.fullmatch(k) for k in top)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    close(streamed(sse(srv, "/v1/completions", body))[0], whole)


def test_a_truncated_chat_as_token_ids_streamed_or_not(srv):
    """A chat cut after its template (n = 2): its logprobs those of the kept tokens sent alone, its tokens as ids,
    each entry's bytes its decoded text's (vLLM's), streamed or not."""
    rendered = ok(srv, "/tokenize", {"messages": HI})["tokens"]
    body = {"messages": HI, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2, "n": 2,
            "truncate_prompt_tokens": 9, "return_tokens_as_token_ids": True}
    r = ok(srv, "/v1/chat/completions", body)
    assert r["usage"]["prompt_tokens"] == 9
    whole = choices(r, chat=True)
    close(streamed(sse(srv, "/v1/chat/completions", body), chat=True), whole)
    alone = ok(srv, "/v1/completions", {"prompt": rendered[-9:], "max_tokens": 4, "temperature": 0, "logprobs": 2,
                                        "return_tokens_as_token_ids": True})["choices"][0]
    for c in whole.values():
        content = c["logprobs"]["content"]
        assert c["token_ids"] == alone["token_ids"]
        assert [e["token"] for e in content] == alone["logprobs"]["tokens"]
        close([e["logprob"] for e in content], alone["logprobs"]["token_logprobs"])
        close([{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in content],
              alone["logprobs"]["top_logprobs"])
        assert [e["bytes"] for e in content] == [list(srv.tok.decode([t]).encode()) for t in c["token_ids"]]


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_a_special_tokens_chat_bytes_as_token_ids_are_its_text(special_srv, stream):
    """vLLM's bytes with return_tokens_as_token_ids: the token's decoded text's, a special token's its text (its
    Logprob.decoded_token: decoded alone, special tokens kept), whatever skip_special_tokens does to the message.
    Regression: decoded as the message is, a special token's bytes were [] (no text)."""
    body = {"messages": HI, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "logit_bias": {str(SPECIAL): 100}, "return_tokens_as_token_ids": True}
    c = streamed(sse(special_srv, "/v1/chat/completions", body), chat=True)[0] if stream else \
        choices(ok(special_srv, "/v1/chat/completions", body), chat=True)[0]
    assert c["token_ids"] == [SPECIAL] * 3 and c["text"] == ""  # (skip_special_tokens: the message has no "<s>")
    for e in c["logprobs"]["content"]:
        assert e["token"] == f"token_id:{SPECIAL}" and e["bytes"] == list(b"<s>")
        assert [a["bytes"] for a in e["top_logprobs"]] == [list(a["token"].encode()) for a in e["top_logprobs"]]


def test_a_bad_truncation_in_a_batch_names_the_field_not_a_prompt(srv):
    r = post(srv, "/v1/completions", {"prompt": [TEXT, TEXT], "max_tokens": 2, "truncate_prompt_tokens": 0,
                                      "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text

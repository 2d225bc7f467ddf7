"""vLLM's request fields that its OpenAI server's users send (each was an "unknown field" 400 here):
`truncate_prompt_tokens` (the prompt's last k tokens; -1: the longest prompt the request can have),
`stream_options.continuous_usage_stats` (every streamed chunk carries its choice's usage so far) and
`return_tokens_as_token_ids` (logprobs' tokens as "token_id:N"). The HTTP server on the CPU (tiny preset,
a byte-level tokenizer with a chat template: one token per byte of ASCII text)."""
from __future__ import annotations

import json
import re

import pytest

from server_fixtures import byte_level_server, ok, post, sse, tiny_config

TEXT = "the quick brown fox jumps over the lazy dog"
HI = [{"role": "user", "content": "hello there, how are you today?"}]
TOKEN_ID = re.compile(r"token_id:\d+")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    # a small pool (160 tokens of K/V), so that -1's bound (the context less max_tokens - 1) is reachable
    with byte_level_server(tmp_path_factory, tiny_config(num_pages=40, max_new_tokens_limit=16)) as s:
        yield s


# -- truncate_prompt_tokens -------------------------------------------------------------------------
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "ids"])
def test_truncation_keeps_the_prompts_last_k_tokens(srv, as_ids):
    ids = srv.tok.encode(TEXT)
    assert len(ids) == len(TEXT)
    base = {"max_tokens": 6, "temperature": 0}
    cut = ok(srv, "/v1/completions", {**base, "prompt": ids if as_ids else TEXT, "truncate_prompt_tokens": 7})
    alone = ok(srv, "/v1/completions", {**base, "prompt": ids[-7:]})
    assert cut["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"] == 7
    assert cut["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert cut["choices"][0]["text"] == alone["choices"][0]["text"]
    # k at or past the prompt's length changes nothing
    whole = ok(srv, "/v1/completions", {**base, "prompt": TEXT, "truncate_prompt_tokens": len(ids) + 3})
    assert whole["usage"]["prompt_tokens"] == len(ids)


def test_a_batchs_prompts_are_each_truncated(srv):
    body = {"prompt": [TEXT, TEXT[:5]], "max_tokens": 2, "temperature": 0, "truncate_prompt_tokens": 4}
    assert ok(srv, "/v1/completions", body)["usage"]["prompt_tokens"] == 8


def test_a_chat_is_truncated_after_its_template(srv):
    rendered = ok(srv, "/tokenize", {"messages": HI})["tokens"]
    assert len(rendered) > 9
    chat = ok(srv, "/v1/chat/completions", {"messages": HI, "max_tokens": 5, "temperature": 0,
                                            "truncate_prompt_tokens": 9})
    alone = ok(srv, "/v1/completions", {"prompt": rendered[-9:], "max_tokens": 5, "temperature": 0})
    assert chat["usage"]["prompt_tokens"] == 9
    assert chat["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]


def test_echo_shows_the_kept_prompt(srv):
    body = {"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 1, "truncate_prompt_tokens": 8}
    r = ok(srv, "/v1/completions", body)
    choice = r["choices"][0]
    assert choice["text"] == TEXT[-8:] and r["usage"]["prompt_tokens"] == 8
    assert choice["logprobs"]["tokens"] == list(TEXT[-8:])
    untouched = ok(srv, "/v1/completions", {**body, "truncate_prompt_tokens": 100})
    assert untouched["choices"][0]["text"] == TEXT


def test_minus_one_keeps_the_longest_prompt_the_request_can_have(srv):
    context = srv.engine.max_kv_tokens  # a request's prompt + max_tokens - 1 tokens of K/V
    long_ids = [ord("a") + i % 26 for i in range(context + 20)]
    assert post(srv, "/v1/completions", {"prompt": long_ids, "max_tokens": 4}).status_code == 400
    r = ok(srv, "/v1/completions", {"prompt": long_ids, "max_tokens": 4, "truncate_prompt_tokens": -1,
                                    "temperature": 0})
    assert r["usage"]["prompt_tokens"] == context - 3
    alone = ok(srv, "/v1/completions", {"prompt": long_ids[-(context - 3):], "max_tokens": 4, "temperature": 0})
    assert r["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    # a short prompt is kept whole
    short = ok(srv, "/v1/completions", {"prompt": TEXT, "max_tokens": 2, "truncate_prompt_tokens": -1})
    assert short["usage"]["prompt_tokens"] == len(TEXT)
    # a chat without max_tokens: the longest prompt (it then gets the rest of the context, within the limit)
    chat = ok(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (context + 9)}],
                                            "truncate_prompt_tokens": -1, "max_tokens": 2})
    assert chat["usage"]["prompt_tokens"] == context - 1


BAD_TRUNCATIONS = [0, -2, -100, "5", 2.5, True]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("value", BAD_TRUNCATIONS, ids=[json.dumps(v) for v in BAD_TRUNCATIONS])
def test_bad_truncations_are_400s_naming_the_field(srv, chat, value):
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": TEXT})
    r = post(srv, path, {**base, "max_tokens": 2, "truncate_prompt_tokens": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_a_truncation_past_the_longest_prompt_is_a_400(srv):
    """vLLM's: k greater than the context less max_tokens is refused, whatever the prompt's length."""
    context = srv.engine.max_kv_tokens
    r = post(srv, "/v1/completions", {"prompt": TEXT, "max_tokens": 4, "truncate_prompt_tokens": context - 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    assert str(context - 3) in r.json()["error"]["message"]
    assert post(srv, "/v1/completions", {"prompt": TEXT, "max_tokens": 4,
                                         "truncate_prompt_tokens": context - 3}).status_code == 200


# -- stream_options.continuous_usage_stats ---------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_continuous_usage_is_in_every_chunk(srv, chat):
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": TEXT})
    body = {**base, "max_tokens": 7, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse(srv, path, body)
    *choice_chunks, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 7
    assert choice_chunks and all(c["choices"] for c in choice_chunks)
    seen = []
    for c in choice_chunks:
        usage = c["usage"]
        assert usage["prompt_tokens"] == final["usage"]["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen.append(usage["completion_tokens"])
    assert seen == sorted(seen) and seen[-1] == final["usage"]["completion_tokens"]
    if chat:  # (vLLM's: a chat's first chunk is its role alone, none generated)
        assert choice_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and seen[0] == 0
        seen = seen[1:]
    assert seen[0] >= 1  # (a chunk is sent with its token: its count includes it)


def test_continuous_usage_counts_each_choices_own_tokens(srv):
    """vLLM's: a chunk's usage is its choice's (its prompt, its tokens so far); the final usage sums them."""
    body = {"prompt": TEXT, "max_tokens": 4, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    *chunks, final = sse(srv, "/v1/completions", body)
    for index in (0, 1):
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"][0]["index"] == index]
        assert counts == [1, 2, 3, 4]
    assert final["usage"]["completion_tokens"] == 8 and final["usage"]["prompt_tokens"] == len(TEXT)


@pytest.mark.parametrize("options", [{"continuous_usage_stats": True},
                                     {"include_usage": False, "continuous_usage_stats": True}])
def test_continuous_usage_needs_include_usage(srv, options):
    """vLLM's: without include_usage, continuous_usage_stats sends nothing (no usage key, no usage chunk)."""
    chunks = sse(srv, "/v1/completions", {"prompt": TEXT, "max_tokens": 3, "stream_options": options})
    assert all("usage" not in c and c["choices"] for c in chunks)


def test_include_usage_alone_is_as_before(srv):
    *chunks, final = sse(srv, "/v1/completions", {"prompt": TEXT, "max_tokens": 3,
                                                  "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in chunks) and final["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("value", ["yes", 1])
def test_a_non_bool_continuous_usage_stats_is_a_400(srv, value):
    r = post(srv, "/v1/completions", {"prompt": TEXT, "max_tokens": 2, "stream": True,
                                      "stream_options": {"include_usage": True, "continuous_usage_stats": value}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.continuous_usage_stats", r.text


def test_responses_refuse_continuous_usage_stats_by_name(srv):
    """/v1/responses' stream_options are Responses' own (include_obfuscation): the chat's field is unknown there."""
    r = post(srv, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True,
                                    "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats", r.text


# -- return_tokens_as_token_ids ---------------------------------------------------------------------
def test_completion_logprobs_as_token_ids(srv):
    body = {"prompt": TEXT, "max_tokens": 5, "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True}
    ok(srv, "/v1/completions", body)  # (the prompt now cached for both: its tail's logprobs the same)
    choice = ok(srv, "/v1/completions", body)["choices"][0]
    lp, ids = choice["logprobs"], choice["token_ids"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert token in top and all(TOKEN_ID.fullmatch(k) for k in top) and 2 <= len(top) <= 3
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids))]  # (vLLM's: the pieces')
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in sse(srv, "/v1/completions", body):
        for key in streamed:
            streamed[key] += (c["choices"][0]["logprobs"] or {}).get(key, [])
    assert streamed == lp
    # off (the default): decoded pieces as before
    plain = ok(srv, "/v1/completions", {**body, "return_tokens_as_token_ids": False})["choices"][0]["logprobs"]
    assert plain["tokens"] == [srv.tok.decode([t]) or f"token_id:{t}" for t in ids]


def test_an_echoed_prompts_logprobs_as_token_ids(srv):
    body = {"prompt": TEXT[:6], "max_tokens": 2, "echo": True, "logprobs": 1, "return_tokens_as_token_ids": True}
    choice = ok(srv, "/v1/completions", body)["choices"][0]
    assert choice["text"].startswith(TEXT[:6])  # (the text itself is text)
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in srv.tok.encode(TEXT[:6]) + choice["token_ids"]]


def test_chat_logprobs_as_token_ids(srv):
    body = {"messages": HI, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True}
    ok(srv, "/v1/chat/completions", body)  # (the prompt now cached for both: its tail's logprobs the same)
    choice = ok(srv, "/v1/chat/completions", body)["choices"][0]
    content, ids = choice["logprobs"]["content"], choice["token_ids"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    for entry, t in zip(content, ids):
        # vLLM's bytes: the sampled token's decoded text's, each alternative's its "token_id:N"'s
        assert entry["bytes"] == list(srv.tok.decode([t]).encode("utf-8"))
        assert len(entry["top_logprobs"]) == 2
        for alt in entry["top_logprobs"]:
            assert TOKEN_ID.fullmatch(alt["token"]) and alt["bytes"] == list(alt["token"].encode("utf-8"))
    streamed = [e for c in sse(srv, "/v1/chat/completions", body) if c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_token_ids_without_logprobs_change_nothing(srv, chat):
    path, base = ("/v1/chat/completions", {"messages": HI}) if chat else ("/v1/completions", {"prompt": TEXT})
    r = ok(srv, path, {**base, "max_tokens": 2, "return_tokens_as_token_ids": True})
    assert r["choices"][0]["logprobs"] is None
    bad = post(srv, path, {**base, "max_tokens": 2, "return_tokens_as_token_ids": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_tokens_as_token_ids", bad.text

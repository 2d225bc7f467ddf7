"""HTTP-layer behaviour no test checked (session 55's mutation check: each could be changed and every test passed;
each test here fails on its mutant): a batch's choices carry their own prompt's token ids; vllm:num_preemptions is
the engine's count and no vllm: family exports _created samples; n choices' usage takes the choice that hit least;
/v1/responses passes vLLM's priority on; stream_options without stream is a 400; a body of exactly
--max-body-bytes is taken; streams go uncached and unbuffered; a 503 is typed service_unavailable; a token id equal
to the vocabulary size is the API's invalid_token_id; a stop string the flush completes within min_tokens does not
match."""
from __future__ import annotations

import json

import httpx
import pytest

from scheduler.prom import ServerMetrics
from scheduler.server import ServerLimits
from scheduler.stop_strings import CompletionText
from scheduler.tokenizer import HFTokenizer
from server_fixtures import byte_level_server, ok, post, sse, tiny_config
from test_server_text import _write_byte_level_tokenizer

BODY_LIMIT = 300


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16)) as s:
        yield s


def test_a_batchs_choices_carry_their_own_prompts_token_ids(srv):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    got = ok(srv, "/v1/completions", {"prompt": prompts, "max_tokens": 2, "temperature": 0, "n": 2,
                                      "return_token_ids": True})
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in got["choices"]] == [prompts[0], prompts[0], prompts[1], prompts[1]]


def test_n_choices_usage_counts_the_cached_tokens_of_the_choice_that_hit_least(srv):
    chunks = sse(srv, "/v1/completions", {"prompt": list(range(20, 60)), "max_tokens": 3, "temperature": 1.0,
                                          "seed": 1, "n": 4, "ignore_eos": True,
                                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    per_choice = {c["choices"][0]["index"]: c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in chunks[:-1]}
    assert len(set(per_choice.values())) > 1, per_choice  # (one computed the prompt, the others hit it)
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == min(per_choice.values())


def test_the_metrics_report_the_engines_preemptions_and_no_created_samples(srv, monkeypatch):
    status = srv.engine.status()
    status["engine"]["preempted"] = 3
    monkeypatch.setattr(srv.engine, "status", lambda: status)
    lines = ServerMetrics(srv.engine, "m").render().decode().splitlines()
    assert 'vllm:num_preemptions_total{model_name="m"} 3.0' in lines
    assert not [ln for ln in lines if ln.startswith(("vllm:", "# TYPE vllm:")) and "_created" in ln]  # (as vLLM's)


def test_the_responses_api_passes_priority_on(srv):
    """(A server without --scheduling-policy priority refuses a non-zero one: the chat's 400, on both routes.)"""
    chat = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                              "priority": 5})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "priority", chat.text
    r = post(srv, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "priority": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text


def test_stream_options_without_stream_is_a_400(srv):
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = post(srv, route, {**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


def test_a_stream_is_sent_uncached_and_unbuffered(srv):
    """(Else a proxy such as nginx may cache or buffer the events.)"""
    with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        r.read()
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers.get("cache-control") == "no-cache" and r.headers.get("x-accel-buffering") == "no", r.headers


def test_a_503_is_typed_service_unavailable(srv):
    state = srv.app.state.hc
    state.draining = True
    try:
        r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    finally:
        state.draining = False
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text


def test_a_token_id_equal_to_the_vocabulary_size_is_an_invalid_token_id(srv):
    r = post(srv, "/v1/completions", {"prompt": [1, srv.engine.vocab_size], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_token_id", r.text


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16),
                           limits=ServerLimits(max_body_bytes=BODY_LIMIT, shutdown_grace_s=1.0)) as s:
        yield s


@pytest.mark.parametrize("size, status", [(BODY_LIMIT, 200), (BODY_LIMIT + 1, 413)])
def test_a_body_of_exactly_the_limit_is_taken(limited, size, status):
    base = {"prompt": "", "max_tokens": 1, "temperature": 0}
    body = json.dumps({**base, "prompt": "a" * (size - len(json.dumps(base).encode()))}).encode()
    assert len(body) == size
    r = httpx.post(limited.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text


def test_a_stop_string_the_flush_completes_within_min_tokens_does_not_match(tmp_path):
    """(vLLM V1: no stop string matches in the first min_tokens tokens' text, also where that text comes out only
    at the end: an incomplete character flushed as U+FFFD.)"""
    _write_byte_level_tokenizer(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    ids = tok.encode("a\u00e9", add_special_tokens=False)  # ('a', then é's two bytes)
    assert len(ids) == 3
    text = CompletionText(tok, [], stops=["a\ufffd"], min_tokens=2)
    out = "".join(text.feed(t) for t in ids[:2]) + text.flush()  # ('a' and é's lead byte alone)
    assert not text.stopped and text.matched is None and out == "a\ufffd"

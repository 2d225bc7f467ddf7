"""Session 76: a chat whose rendered text the server's tokenizer fails to encode is the server's failure.

A checkpoint's tokenizer.json can fail on text its template rendered (here a word-level vocabulary whose unk token is
missing from it: tokenizers raises "Missing [UNK] token from the vocabulary" for any word it does not know). The same
text as a completion's prompt is a 500, counted failed; a chat's was a 400 "the chat template rejected the messages"
on 'messages', counted rejected: the client was told its messages were wrong and the operator's failure counter never
moved, where the fault is the server's tokenizer. It is now a 500 naming the tokenizer, counted failed, as the
completion's is."""
from __future__ import annotations

import json

import httpx
import pytest

from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from server_fixtures import tiny_config
from test_server import ServerThread, metric_samples

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
KNOWN, UNKNOWN = "hi there", "hi zebra"


def _write_unk_less_tokenizer(path) -> None:
    """A word-level tokenizer.json whose unk token is not in its vocabulary, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hi": 5, "there": 6}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    _write_unk_less_tokenizer(path)
    engine = Engine(tiny_config(max_new_tokens_limit=8))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=HFTokenizer(str(path)))) as s:
        yield s


def _outcomes(url: str) -> dict[str, float]:
    samples = metric_samples(url)
    return {o: samples.get(("hicache_requests_total", (("outcome", o),)), 0.0) for o in ("rejected", "failed")}


def test_the_tokenizer_failing_on_a_rendered_chat_is_a_server_error_counted_failed(srv):
    ok = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                    json={"messages": [{"role": "user", "content": KNOWN}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text  # (the template and the tokenizer work on text it knows)
    before = _outcomes(srv.url)
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": UNKNOWN}], "max_tokens": 2})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["param"] is None, error
    assert "tokenizer" in error["message"] and "Missing [UNK]" in error["message"], error
    assert "chat template rejected" not in error["message"], error
    after = _outcomes(srv.url)
    assert (after["failed"] - before["failed"], after["rejected"] - before["rejected"]) == (1, 0)


def test_the_same_text_as_a_completions_prompt_fails_the_same_way(srv):
    """(the reference: the text alone, no template, was a 500 already)"""
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": UNKNOWN + " ", "max_tokens": 2}, timeout=60)
    assert r.status_code == 500 and "Missing [UNK]" in r.json()["error"]["message"], r.text


def test_tokenize_of_such_a_chat_is_a_server_error_too(srv):
    r = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": UNKNOWN}]}, timeout=60)
    assert r.status_code == 500, r.text
    assert "tokenizer" in r.json()["error"]["message"] and "chat template rejected" not in r.text

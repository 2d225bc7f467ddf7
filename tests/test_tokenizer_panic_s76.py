"""A checkpoint's tokenizer.json on which the Rust tokenizers library panics as it encodes (here a truncation whose
stride is not below its max_length: "`stride` must be strictly less than `max_len`"). tokenizers raises
`pyo3_runtime.PanicException`, a BaseException, not an Exception (session 76): it went past every `except Exception`
(the chat's "tokenizer failed on the rendered chat", the app's error handler, which Starlette runs for Exceptions only)
to uvicorn, which answered a text/plain "Internal Server Error" with no OpenAI error body, no code, no message (the
server's accounting stayed whole: its slot, in_flight and the failed count). It is now the tokenizer's failure, a
TokenizerError: a JSON 500 naming it, as any other failure of the server's tokenizer."""
from __future__ import annotations

import json

import httpx
import pytest

from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer, TokenizerError
from server_fixtures import tiny_config
from test_server import ServerThread, metric_samples

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
LONG = "a b c d e"  # (more words than the truncation's max_length: it panics)


def _write_panicking_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    spec = json.loads(tok.to_str())
    spec["truncation"] = {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 4}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    _write_panicking_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def srv(tok_dir):
    engine = Engine(tiny_config(max_new_tokens_limit=8))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=HFTokenizer(str(tok_dir)))) as s:
        yield s


def test_a_panic_encoding_is_the_tokenizers_error(tok_dir):
    tok = HFTokenizer(str(tok_dir))
    assert tok.encode("a b") == [1, 2]  # (within its max_length: no panic)
    with pytest.raises(TokenizerError, match="stride"):
        tok.encode(LONG)


def _failed(url: str) -> float:
    return metric_samples(url).get(("hicache_requests_total", (("outcome", "failed"),)), 0.0)


@pytest.mark.parametrize("route,body,counted", [
    ("/v1/completions", {"prompt": LONG, "max_tokens": 2}, True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2}, True),
    ("/tokenize", {"prompt": LONG}, False),
])
def test_a_tokenizer_panic_is_a_json_server_error_and_the_server_serves_on(srv, route, body, counted):
    before = _failed(srv.url)
    r = httpx.post(srv.url + route, json=body, timeout=60)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and "stride" in error["message"], error
    assert _failed(srv.url) - before == counted
    status = httpx.get(srv.url + "/hicache/status", timeout=60).json()
    assert status["server"]["in_flight"] == 0 and status["engine"]["running"] == 0
    ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "a b", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text

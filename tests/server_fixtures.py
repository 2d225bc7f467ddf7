"""The HTTP server most API tests talk to: the tiny preset on the CPU behind a byte-level checkpoint
tokenizer with a chat template (one token per byte of ASCII text), served by a ServerThread; plus the
JSON / SSE calls those tests make to it. A test module's fixture is then a few lines:

    @pytest.fixture(scope="module")
    def srv(tmp_path_factory):
        with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16)) as s:
            yield s
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator

import httpx

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_server import ServerThread
from test_server_text import _write_byte_level_tokenizer


def tiny_config(num_pages: int = 256, **overrides) -> EngineConfig:
    """The tiny preset on the CPU in pages of 4 tokens (the tests' page arithmetic counts on 4)."""
    return EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=num_pages, **overrides)


@contextmanager
def byte_level_server(tmp_path_factory, config: EngineConfig, chat_template: str | None = None,
                      limits: ServerLimits | None = None) -> Iterator[ServerThread]:
    """An engine of `config` served over HTTP with the byte-level tokenizer (its own chat template, or
    `chat_template`) under `limits` (none: a 1 s shutdown grace); the server carries its `engine` and `tok` (the
    tokenizer) for the tests to look at."""
    path = tmp_path_factory.mktemp("tok")
    _write_byte_level_tokenizer(path)
    if chat_template is not None:
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    engine = Engine(config)
    tok = HFTokenizer(str(path))
    with ServerThread(create_app(engine, limits or ServerLimits(shutdown_grace_s=1.0), tokenizer=tok)) as s:
        s.engine, s.tok = engine, tok
        yield s


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def ok(srv, path: str, body: dict) -> dict:
    """A call that must succeed: its JSON."""
    r = post(srv, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(srv, path: str, body: dict) -> list[dict]:
    """A streamed call's chunks (the `data: [DONE]` that must end it left out)."""
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]

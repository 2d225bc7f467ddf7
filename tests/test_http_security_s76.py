"""Session 76's hunt of the HTTP surface's guards: what the open routes show, and an API key no client can send.

* A shared Redis L3 reached over TLS with a passphrase-protected client key takes the passphrase in its URL's query
  (redis-py's `ssl_password`): it was shown unmasked by /hicache/status (a route open without the key), the replay's
  printed config and the L3's log lines, where `password` and `username` were masked.
* An API key that starts or ends with whitespace (HICACHE_API_KEY from a secret file's trailing newline) or holds a
  control character can never be sent: a header's value loses its surrounding whitespace and holds no control
  character. The server started, and then refused every /v1/ request with "a wrong API key was given"."""
from __future__ import annotations

import asyncio
import json

import pytest
from hicache_helpers import make_manager
from starlette.testclient import TestClient

from scheduler import serve
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app

PASSPHRASE = "key-passphrase-76"


# -- a Redis URL's TLS key passphrase ----------------------------------------------------------------------
def test_a_redis_urls_tls_key_passphrase_is_masked_where_the_url_is_shown():
    from hicache.redis_limits import redact_url

    url = f"rediss://:pw@127.0.0.1:1/0?ssl_keyfile=k.pem&ssl_password={PASSPHRASE}"
    assert redact_url(url) == "rediss://:***@127.0.0.1:1/0?ssl_keyfile=k.pem&ssl_password=***"
    # what /hicache/status shows of the L3 (CacheManager.status; the store connects on first use)
    mgr = make_manager(storage_backend="redis", storage_url=url, model_id="m")
    try:
        shown = json.dumps(mgr.status()["storage"])
        assert PASSPHRASE not in shown and "ssl_password=***" in shown
    finally:
        asyncio.run(mgr.close())


# -- an API key no client can send ---------------------------------------------------------------------------
def parse(*argv: str):
    return serve.build_parser().parse_args(["--port", "0", "--model", "tiny", *argv])


@pytest.mark.parametrize("key", ["sk-76\n", " sk-76", "sk-76 ", "\tsk-76", "sk\x1b76", "sk\r\n76", "sk-76\x7f"])
def test_an_api_key_no_header_can_carry_is_refused_at_start_naming_where_it_came_from(key, monkeypatch, capsys):
    monkeypatch.delenv("HICACHE_API_KEY", raising=False)
    said = serve._check_server_args(parse("--api-key", key))
    assert said is not None and said.startswith("--api-key ") and key not in said
    monkeypatch.setenv("HICACHE_API_KEY", key)  # (a secret file's trailing newline, say)
    said = serve._check_server_args(parse())
    assert said is not None and said.startswith("HICACHE_API_KEY ") and key not in said
    # refused before the model loads: exit status 2, one line
    assert serve.main(["--port", "0", "--device", "cpu", "--model", "tiny"]) == 2
    assert "hicache-serve: HICACHE_API_KEY " in capsys.readouterr().err
    # the in-process API: create_app refuses it too, naming the field (never the key)
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=16))
    with pytest.raises(ValueError, match="ServerLimits.api_key") as exc:
        create_app(engine, ServerLimits(api_key=key))
    assert key not in str(exc.value)


@pytest.mark.parametrize("key", ["sk-76", "sk 76", "sk\t76", "clé-76"])
def test_an_api_key_a_header_can_carry_is_taken(key, monkeypatch):
    monkeypatch.setenv("HICACHE_API_KEY", key)
    assert serve._check_server_args(parse()) is None
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=16))
    client = TestClient(create_app(engine, ServerLimits(api_key=key)))  # (no `with`: the engine is not started)
    auth = {"Authorization": b"Bearer " + key.encode()}
    assert client.get("/v1/models", headers=auth).status_code == 200
    assert client.get("/v1/models").status_code == 401


# -- a compressed body --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions", "/reset_prefix_cache"])
def test_a_compressed_body_is_a_415_naming_its_content_encoding_not_invalid_json(path):
    """No route decompresses a body (so no zip bomb either): a gzip one was a 400 "not valid JSON" (what was wrong
    was the encoding), and one marked "br" whose bytes happened to be plain JSON was taken as it was."""
    import gzip

    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=16))
    client = TestClient(create_app(engine, ServerLimits()))  # (not started: every answer here comes first)
    body = json.dumps({"prompt": "hi"}).encode()
    for encoding, content in (("gzip", gzip.compress(body)), ("br", body), ("deflate, gzip", body)):
        r = client.post(path, content=content, headers={"Content-Type": "application/json",
                                                        "Content-Encoding": encoding})
        assert r.status_code == 415, r.text
        err = r.json()["error"]
        assert err["code"] == "unsupported_content_encoding" and "Content-Encoding" in err["message"]
    assert client.post("/tokenize", content=body, headers={"Content-Type": "application/json",
                                                           "Content-Encoding": "identity"}).status_code == 200

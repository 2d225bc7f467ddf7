"""Regressions from session 53's hunt of text with a real BPE / WordPiece tokenizer: a cache_salt holding a lone
surrogate is a 400 naming it (it raised in the engine loop's admission, which died: every later request a 503),
and vLLM's spaces_between_special_tokens false joins consecutive added tokens without the decoder's space (it was
accepted and ignored)."""
from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from scheduler.request import RequestError, SamplingParams
from scheduler.server import ServerLimits, create_app
from scheduler.engine import Engine
from scheduler.tokenizer import HFTokenizer, IncrementalDecoder
from server_fixtures import byte_level_server, sse, tiny_config
from test_server import ServerThread

SEP = 2  # (the WordPiece vocabulary's [SEP])


def test_a_salt_utf8_cannot_encode_is_a_request_error():
    with pytest.raises(RequestError) as err:
        SamplingParams(max_tokens=2, cache_salt="a\ud800b").validate(16)
    assert err.value.param == "cache_salt" and "Unicode" in str(err.value)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with byte_level_server(tmp_path_factory, tiny_config(), chat_template=template) as s:
        yield s


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})])
def test_a_surrogate_salt_is_a_400_and_the_server_serves_on(srv, route, body):
    raw = json.dumps({**body, "cache_salt": "SALT"}).replace("SALT", "a\\ud800b")  # (JSON's escape of a lone one)
    r = httpx.post(srv.url + route, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"
    assert httpx.post(srv.url + route, json=body, timeout=60).status_code == 200
    assert httpx.get(srv.url + "/health", timeout=60).status_code == 200


def wordpiece_dir(tmp_path) -> str:
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": SEP, **{c: 3 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # (joins tokens with spaces, specials too)
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("[UNK]", "[CLS]", "[SEP]")])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    return str(tmp_path)


@pytest.mark.parametrize("spaces,expected", [(True, "a [SEP] [SEP] [SEP] b"), (False, "a [SEP][SEP][SEP] b")])
def test_the_decoder_joins_added_tokens_as_vllm_v1(tmp_path, spaces, expected):
    tok = HFTokenizer(wordpiece_dir(tmp_path))
    ids = tok.encode("a", add_special_tokens=False) + [SEP] * 3 + tok.encode("b", add_special_tokens=False)
    dec = IncrementalDecoder(tok, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert "".join(dec.feed(t) for t in ids) + dec.flush() == expected
    skipped = IncrementalDecoder(tok, skip_special_tokens=True, spaces_between_special_tokens=spaces)
    assert "".join(skipped.feed(t) for t in ids) + skipped.flush() == tok.decode(ids)  # (no specials: no effect)


@pytest.mark.parametrize("spaces,expected", [(True, " [SEP] [SEP] [SEP]"), (False, " [SEP][SEP][SEP]")])
def test_spaces_between_special_tokens_over_http(tmp_path, spaces, expected):
    app = create_app(Engine(tiny_config()), ServerLimits(shutdown_grace_s=1.0),
                     tokenizer=HFTokenizer(wordpiece_dir(tmp_path)))
    body = {"prompt": "a", "max_tokens": 3, "temperature": 0, "logit_bias": {str(SEP): 100},
            "skip_special_tokens": False, "spaces_between_special_tokens": spaces}
    with ServerThread(app) as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        assert "".join(c["choices"][0]["text"] for c in sse(s, "/v1/completions", body)) == expected

"""Session 73: a `stop` string that is no text (a lone surrogate: JSON carries "\\ud800", UTF-8 cannot) is a 400
naming `stop`, on completions and chats, streamed or not, as `bad_words` and every other text field already were.
It used to be accepted and could never match: generated text never holds a lone surrogate. A stop string of real
text beside it still works after the refusal (the server serves on; the engine's integrity holds)."""
from __future__ import annotations

import httpx
import pytest
from server_fixtures import byte_level_server, ok, tiny_config

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16)) as s:
        yield s


def post_raw(srv, path: str, raw: str) -> httpx.Response:
    """A body sent as these exact bytes (a lone surrogate's escape stays as JSON allows it)."""
    return httpx.post(srv.url + path, content=raw.encode(), headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("stream", ["false", "true"])
@pytest.mark.parametrize("stop", ['"\\ud800"', '["ok", "x\\udc00"]'])
@pytest.mark.parametrize("path,body", [("/v1/completions", '"prompt": "hi"'),
                                       ("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}]')])
def test_a_stop_string_holding_a_lone_surrogate_is_a_400_naming_stop(srv, path, body, stop, stream):
    r = post_raw(srv, path, f'{{{body}, "max_tokens": 4, "stream": {stream}, "stop": {stop}}}')
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("stop", "invalid_value"), err
    assert "the stop is not valid Unicode text" in err["message"] and "surrogate" in err["message"], err
    assert not srv.engine.requests
    srv.call(srv.engine.check_integrity)
    answer = ok(srv, path, {**({"prompt": "hi"} if "prompt" in body else {"messages": HI}), "max_tokens": 4,
                            "stop": ["\u00e9", "ok"]})
    assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer

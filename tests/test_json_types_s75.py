"""JSON values of the wrong type or at the edge of their type, sent to the HTTP routes (session 75): a field name or
value UTF-8 cannot carry (a lone surrogate, "\\ud800", which JSON's escapes allow) is a clean 400 naming the field,
never a 500. Real server on the CPU (tiny preset)."""
from __future__ import annotations

import httpx
import pytest

from server_fixtures import byte_level_server, ok, tiny_config


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16)) as s:
        yield s


def _raw(srv, path: str, text: str) -> httpx.Response:
    """A body sent as written (json= would have to encode the surrogate itself, which UTF-8 cannot)."""
    return httpx.post(srv.url + path, content=text.encode("ascii"), headers={"content-type": "application/json"},
                      timeout=60)


def test_reset_prefix_cache_field_name_with_a_lone_surrogate_is_a_400(srv):
    r = _raw(srv, "/reset_prefix_cache", '{"\\ud800": true}')
    assert r.status_code == 400, r.text  # (it was a 500: the error's param, the name as sent, could not be encoded)
    err = r.json()["error"]
    assert err["code"] == "unknown_field" and err["param"] == "\\ud800"
    assert "unknown field" in err["message"]
    ok(srv, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})  # (the server serves on)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": [1], "\\ud800": NaN}', "\\ud800"),
    ("/v1/completions", '{"prompt": [1], "metadata": {"\\ud800": Infinity}}', "metadata.\\ud800"),
    ("/v1/chat/completions", '{"messages": [], "x": {"\\ud800": -Infinity}}', "x.\\ud800"),
    ("/v1/responses", '{"input": "a", "\\ud800": 1e400}', "\\ud800"),
    ("/tokenize", '{"\\ud800": NaN}', "\\ud800"),
    ("/reset_prefix_cache", '{"\\ud800": NaN}', "\\ud800"),
])
def test_a_non_finite_number_under_a_lone_surrogate_name_is_a_400(srv, path, body, param):
    r = _raw(srv, path, body)
    assert r.status_code == 400, r.text  # (it was a 500: the name, the error's param, could not be sent as UTF-8)
    err = r.json()["error"]
    assert err["code"] == "invalid_value" and err["param"] == param and "finite number" in err["message"]


@pytest.mark.parametrize("path, head", [("/v1/completions", '{"prompt": [1], '), ("/detokenize", '{"tokens": [], ')])
def test_a_body_nested_too_deep_under_a_lone_surrogate_name_is_a_400(srv, path, head):
    r = _raw(srv, path, head + '"\\ud800": ' + "[" * 200 + "]" * 200 + "}")
    assert r.status_code == 400, r.text  # (it was a 500: the path named in the error could not be sent)
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and err["param"] == "\\ud800" and "nests deeper" in err["message"]
    ok(srv, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})

"""An error's `param` names the field as the client sent it, with its path where it is nested (session 77's hunt of
the HTTP API's error replies): a validation error of a nested field named only its top-level field
(`messages` for a bad `messages.1.content`, `stream_options` for a bad `stream_options.include_usage`), where the
server's other errors of nested fields name their path (`logit_bias.5` for a NaN bias, `prompt.1` for a batch's
prompt, `reasoning.effort`), and OpenAI's name the nested field too."""
from __future__ import annotations

import httpx
import pytest

from server_fixtures import byte_level_server, post, tiny_config

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16)) as s:
        yield s


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def _raw(srv, path: str, body: str) -> httpx.Response:
    return httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"messages": [HI, {"role": "user", "content": 3}]}, "messages.1.content"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages.0.role"),
    (CHAT, {"messages": [HI, {"role": "user", "content": "hi", "colour": 1}]}, "messages.1.colour"),
    (CHAT, {"messages": [HI], "stream": True, "stream_options": {"include_usage": 3}}, "stream_options.include_usage"),
    (COMPLETIONS, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    (COMPLETIONS, {"prompt": "hi", "stream": True, "stream_options": {"colour": True}}, "stream_options.colour"),
    (CHAT, {"messages": [HI], "tools": [{"type": "function", "function": {"name": 5}}]}, "tools.0.function.name"),
])
def test_a_nested_fields_error_names_its_path(srv, path, body, param):
    err = _error(post(srv, path, {"max_tokens": 2, **body}))
    assert err["param"] == param and f"'{param}'" in err["message"], err


def test_a_bias_out_of_range_names_its_token_as_a_non_finite_one_does(srv):
    """The same field, the same path: a bias of 1000 and a bias of NaN on token 5 are both `logit_bias.5`."""
    out_of_range = _error(post(srv, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 1000}}))
    nan = _error(_raw(srv, COMPLETIONS, '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": NaN}}'))
    assert out_of_range["param"] == nan["param"] == "logit_bias.5", (out_of_range, nan)


def test_tokenize_names_a_messages_field_as_the_chat_does(srv):
    body = {"messages": [HI, {"role": "user", "content": 3}]}
    chat, tok = _error(post(srv, CHAT, body)), _error(post(srv, "/tokenize", body))
    assert chat["param"] == tok["param"] == "messages.1.content", (chat, tok)


def test_a_top_level_field_is_named_alone(srv):
    assert _error(post(srv, COMPLETIONS, {"prompt": "hi", "max_tokens": "2"}))["param"] == "max_tokens"
    assert _error(post(srv, COMPLETIONS, {"prompt": "hi", "colour": 1}))["param"] == "colour"


def test_a_responses_input_error_names_input(srv):
    """A Responses body's messages are its `input`: a chat error of a message is named by it (api_responses)."""
    err = _error(post(srv, "/v1/responses", {"input": [{"role": "user", "content": 3}], "max_output_tokens": 2}))
    assert err["param"] == "input", err


def test_a_lone_surrogate_in_a_key_names_the_object_holding_it(srv):
    """A dict's key pydantic's path mangles ("metadata.\ufffd\ufffd\ufffd" for "\\udfff"): the dict is named."""
    err = _error(_raw(srv, COMPLETIONS, '{"prompt": "hi", "max_tokens": 2, "metadata": {"\\udfff": "v"}}'))
    assert err["param"] == "metadata" and "field name '\\udfff'" in err["message"], err

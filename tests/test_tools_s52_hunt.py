"""Regressions from session 52's hunt of tool calls and JSON schemas: call arguments keep the numbers the model wrote
(1E999 came back as Infinity, no JSON); a hermes block whose "arguments" is a string of no JSON object is text (it
was a call of arguments "hello"); a required tool_choice takes parameters that use "$anchor" or "$id" as the other
modes do (400s); an integer bound past 64 bits is a 400 (llguidance clamped it: an answer below the minimum)."""
from __future__ import annotations

import json

import pytest

from scheduler.api_tools import required_calls
from scheduler.tool_calls import call_of
from server_fixtures import byte_level_server, post, tiny_config

MESSAGES = [{"role": "user", "content": "q"}]


def test_required_calls_keep_the_models_numbers():
    [call] = required_calls('[{"name":"f","parameters":{"x":1E999,"y":[4E7,-0.5,true,null,"\\u00e9"]}}]')
    assert call.arguments == '{"x": 1E999, "y": [4E7, -0.5, true, null, "é"]}'
    assert "Infinity" not in call.arguments and json.loads(call.arguments)["y"][0] == 4e7


@pytest.mark.parametrize("body, arguments", [
    ('{"name": "f", "arguments": {"a": 1e400}}', '{"a": 1e400}'),
    ('{"name": "f", "arguments": "{\\"a\\": 1}"}', '{"a": 1}'),  # (JSON text of an object: taken)
    ('{"name": "f", "parameters": {}}', '{}'),
    ('{"name": "f", "arguments": "hello"}', None), ('{"name": "f", "arguments": "{bad"}', None),
    ('{"name": "f", "arguments": "[1, 2]"}', None),
    ('{"name": "f", "arguments": null}', '{}'),  # (none, as a request's null arguments read: session 80)
])
def test_a_hermes_blocks_arguments_are_a_json_object(body, arguments):
    call = call_of(body)
    assert (None if call is None else call.arguments) == arguments


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config()) as s:
        yield s


ANCHOR = {"type": "object", "properties": {"u": {"$ref": "#unit"}}, "required": ["u"], "additionalProperties": False,
          "$defs": {"U": {"$anchor": "unit", "enum": ["c", "f"]}}}
WITH_ID = {"$id": "https://example.com/weather", "type": "object", "properties": {"u": {"$ref": "#/$defs/U"}},
           "required": ["u"], "additionalProperties": False, "$defs": {"U": {"enum": ["c", "f"]}}}


@pytest.mark.parametrize("parameters", [ANCHOR, WITH_ID], ids=["anchor", "id"])
def test_a_required_tool_choice_takes_what_a_named_one_does(srv, parameters):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    for choice in ({"type": "function", "function": {"name": "f"}}, "required"):
        r = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "tools": tools,
                                               "tool_choice": choice, "max_tokens": 100, "temperature": 0,
                                               "parallel_tool_calls": False})
        assert r.status_code == 200, (choice, r.text)
        [call] = r.json()["choices"][0]["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"])["u"] in ("c", "f")


@pytest.mark.parametrize("bounds", [{"minimum": 1e20, "maximum": 1e20 + 5}, {"minimum": 2 ** 64},
                                    {"exclusiveMaximum": -(2 ** 63) - 10}])
def test_an_integer_bound_past_64_bits_is_a_400(srv, bounds):
    schema = {"type": "object", "properties": {"id": {"type": "integer", **bounds}}, "required": ["id"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "response_format": fmt,
                                           "max_tokens": 30})
    assert r.status_code == 400 and "64-bit" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "response_format"
    within = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 10, "maximum": 2 ** 62}},
              "required": ["id"]}
    fmt["json_schema"]["schema"] = within
    r = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "response_format": fmt,
                                           "max_tokens": 30, "temperature": 0})
    assert r.status_code == 200, r.text


def test_arguments_nested_past_what_is_written_back_are_no_call():
    """(Review of the above) json_text recursed ~2 frames a level: 400 levels parsed, then a RecursionError, a 500."""
    deep = "[" * 400 + "1" + "]" * 400
    assert call_of('{"name": "f", "arguments": {"x": ' + deep + '}}') is None
    assert required_calls('[{"name": "f", "parameters": {"x": ' + deep + '}}]') is None
    assert call_of('{"name": "f", "arguments": {"x": ' + "[" * 100 + "1" + "]" * 100 + '}}') is not None

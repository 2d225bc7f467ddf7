"""The openai SDK's helpers against the server (session 78): what a client of `client.responses` sees.

* A Response's id is the body's `request_id` as given (vLLM's). The SDK refuses to build a path whose segment is
  "." or ".." (RFC 3986's dot-segments, which HTTP clients and proxies normalize away), so a Response named so
  was created but could never be read, listed or deleted through it: such an id is a 400 naming `request_id`, as
  one ending in /input_items is.
* A Responses named `tool_choice` without `tools` was told its choice, quoted in the chat form it was translated
  into ({"type": "function", "function": {"name": ...}}), which the client never sent: the error names the function.

The HTTP server on the CPU (tiny preset, a byte-level tokenizer with a chat template)."""
from __future__ import annotations

import openai
import pytest

from server_fixtures import byte_level_server, tiny_config


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16)) as s:
        yield s


@pytest.mark.parametrize("rid", [".", ".."])
def test_a_request_id_the_sdk_cannot_address_is_a_400_naming_it(client, rid):
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="tiny", input="hi", max_output_tokens=1, extra_body={"request_id": rid})
    assert exc.value.param == "request_id" and "segment" in exc.value.message


@pytest.mark.parametrize("rid", ["...", "a.", ".a", "a/..", "../a"])
def test_a_request_id_with_dots_inside_is_served_and_read_back(client, rid):
    """Dots are fine where the id is not a dot-segment as a whole (the SDK encodes a "/" inside it)."""
    made = client.responses.create(model="tiny", input="hi", max_output_tokens=1, extra_body={"request_id": rid})
    assert made.id == rid and client.responses.retrieve(rid).id == rid
    assert [i.type for i in client.responses.input_items.list(rid)] == ["message"]
    client.responses.delete(rid)


def test_a_named_tool_choice_without_tools_is_told_in_the_responses_form(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="tiny", input="hi", max_output_tokens=1,
                                tool_choice={"type": "function", "name": "get_weather"})
    err = exc.value
    assert err.param == "tool_choice" and "'get_weather'" in err.message and "needs 'tools'" in err.message
    assert '"function": {' not in err.message  # (the chat form: the Responses body has no such object)



BAD_PARAMETERS = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "tag"}}])
def test_a_tools_parameters_schema_that_does_not_compile_is_a_400_naming_tools(client, tool_choice):
    """A "required" or named tool_choice holds the answer to its tools' parameters schemas: one the engine cannot
    compile is the fault of `tools`, told so (regression: param tool_choice, "guided json_schema does not compile",
    a field the client never sent)."""
    tools = [{"type": "function", "function": {"name": "tag", "parameters": BAD_PARAMETERS}}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       tools=tools, tool_choice=tool_choice)
    err = exc.value
    assert err.param == "tools" and "the tools' parameters schema" in err.message, (err.param, err.message)
    assert "guided" not in err.message

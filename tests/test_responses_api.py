"""OpenAI's Responses API (`POST /v1/responses`, scheduler/api_responses.py, scheduler/responses_output.py) through
the openai SDK: text and list input, instructions, max_output_tokens, structured text, function calls sent and
sent back, reasoning items, streams that add up to the whole response, and 400s naming the Responses field."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from scheduler.api_responses import parse_request
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.responses_output import OutputItems, ResponseOutput
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

# Qwen3's template's parts, shortened (as tests/test_tool_calls.py's), with an assistant's thinking written
# back and a think block left open when the first message says "think"
TEMPLATE = (
    "{% if tools %}<system># Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}<assistant>"
    "{% if messages[0].content == 'think' %}<think>\n{% endif %}")
WEATHER = {"type": "function", "name": "get_weather", "description": "today's weather",
           "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
                          "additionalProperties": False}}
CLOCK = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), added=("<think>", "</think>"),
                                config={"chat_template": TEMPLATE})
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=2048))
    limits = ServerLimits(shutdown_grace_s=1.0, tool_call_parser="hermes", reasoning_parser="qwen3")
    with ServerThread(create_app(engine, limits, tokenizer=HFTokenizer(str(path)))) as s:
        yield s


def _chat_call(call_id: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def _chat(srv, messages: list[dict], **body) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _post(srv, **body) -> httpx.Response:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 1, **body}
    return httpx.post(srv.url + "/v1/responses", json=body, timeout=60)


def test_text_input_is_a_user_message_and_max_output_tokens_makes_it_incomplete(srv, client):
    r = client.responses.create(model="tiny", input="hello", max_output_tokens=4, temperature=0, store=True,
                                metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.status == "incomplete" and message.content[0].type == "output_text"
    assert message.content[0].annotations == [] and r.output_text == message.content[0].text
    assert (r.temperature, r.top_p, r.max_output_tokens, r.metadata) == (0, 1, 4, {"k": "v"})
    assert (r.tools, r.tool_choice, r.parallel_tool_calls, r.text.format.type) == ([], "auto", True, "text")
    assert r.model_extra["store"] is True  # (kept: tests/test_responses_store.py)
    chat = _chat(srv, [{"role": "user", "content": "hello"}], max_tokens=4)
    assert r.output_text == chat["choices"][0]["message"]["content"]
    u, cu = r.usage, chat["usage"]
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (cu["prompt_tokens"], 4, cu["prompt_tokens"] + 4)
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0


def test_list_input_and_instructions_are_the_chat_s_messages(srv, client):
    """The same conversation as a chat's messages: the same prompt tokens and (greedy) the same answer, an
    earlier assistant message and its calls, their results, and its thinking (a reasoning item) included."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"unit": "c"}'}
    items = [{"role": "user", "content": "weather?"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look.",
                                                                    "annotations": []}]},
             call, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]}]
    r = client.responses.create(model="tiny", input=items, instructions="you help", max_output_tokens=6,
                                temperature=0, tools=[WEATHER], tool_choice="none")
    messages = [{"role": "system", "content": "you help"}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm",
                 "tool_calls": [_chat_call("call_1", '{"unit": "c"}')]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "developer", "content": "be brief"}]
    chat = _chat(srv, messages, max_tokens=6, tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none")
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.output_text == chat["choices"][0]["message"]["content"]
    plain = client.responses.create(model="tiny", input=items[:1], max_output_tokens=2, temperature=0)
    assert plain.usage.input_tokens < r.usage.input_tokens


def test_a_stream_s_events_in_order_add_up_to_the_whole_response(srv, client):
    kw = dict(model="tiny", input="hello there", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    final = events[-1].response  # (response.incomplete, as OpenAI's: the SDK's get_final_response wants "completed")
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == whole.output_text == "".join(d.delta for d in deltas) and final.status == "incomplete"
    assert final.id == events[0].response.id and final.usage.output_tokens == 8
    item_id = events[2].item.id
    assert all(d.item_id == item_id and d.output_index == 0 for d in deltas)
    with httpx.stream("POST", srv.url + "/v1/responses", json={**kw, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:  # each: its `event:` line naming the data's type
        event, data = block.split("\n")
        assert event == "event: " + json.loads(data.removeprefix("data: "))["type"]


def test_a_json_schema_text_format_holds_the_answer(client):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny", input="json please", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "pick", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed" and json.loads(r.output_text)["a"] in ("x", "y")
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == schema
    obj = client.responses.create(model="tiny", input="json", max_output_tokens=40, temperature=0,
                                  text={"format": {"type": "json_object"}})
    assert obj.output_text.startswith("{")


def test_function_calls_named_and_required_and_sent_back(srv, client):
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model="tiny", input="weather?", tools=[WEATHER, CLOCK], tool_choice=named,
                                max_output_tokens=40, temperature=0)
    [call] = r.output
    assert r.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    assert json.loads(call.arguments)["unit"] in ("c", "f") and r.tool_choice.name == "get_weather"
    with client.responses.stream(model="tiny", input="weather?", tools=[WEATHER, CLOCK], tool_choice=named,
                                 max_output_tokens=40, temperature=0) as stream:
        types = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert types[2] == "response.output_item.added" and types[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "response.function_call_arguments.delta" in types and "response.output_text.delta" not in types
    assert streamed.output[0].arguments == call.arguments and streamed.output[0].name == "get_weather"
    required = client.responses.create(model="tiny", input="weather?", tools=[WEATHER, CLOCK], tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=60, temperature=1.0,
                                       extra_body={"seed": 1})
    [one] = required.output
    assert one.type == "function_call" and one.name in ("get_weather", "get_time")
    # the call and its result sent back, as the SDK gives them: the chat's assistant tool_calls and tool message
    follow = client.responses.create(model="tiny", input=[{"role": "user", "content": "weather?"}, *r.output,
                                                          {"type": "function_call_output", "call_id": call.call_id,
                                                           "output": "sunny"}],
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=2)
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [_chat_call(call.call_id, call.arguments)]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    chat = _chat(srv, messages, max_tokens=2, tool_choice="none", tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}])
    assert follow.usage.input_tokens == chat["usage"]["prompt_tokens"] and follow.usage.output_tokens == 2
    # the stream helper's items (its parsed_arguments added) taken back alike
    again = client.responses.create(model="tiny", input=[{"role": "user", "content": "weather?"}, *streamed.output,
                                                         {"type": "function_call_output", "call_id": call.call_id,
                                                          "output": "sunny"}],
                                    tools=[WEATHER], tool_choice="none", max_output_tokens=2)
    assert again.usage.input_tokens == follow.usage.input_tokens


def test_a_thought_is_a_reasoning_item(client):
    kw = dict(model="tiny", input="hi", instructions="think", max_output_tokens=4, temperature=0,
              reasoning={"effort": "low"})
    r = client.responses.create(**kw)
    [thought] = r.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_") and thought.status == "incomplete"
    assert thought.content[0].type == "reasoning_text" and thought.content[0].text and thought.summary == []
    assert r.output_text == "" and r.reasoning.effort == "low"
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thought.content[0].text and events[-1].response.output[0].content[0].text == deltas
    again = client.responses.create(model="tiny", input=[{"role": "user", "content": "hi"}, *r.output,
                                                         {"role": "user", "content": "and?"}], max_output_tokens=2)
    assert again.status == "incomplete"  # (the item taken back: its assistant turn's reasoning_content)


@pytest.mark.parametrize("body, param, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "not found"),
    ({"conversation": "conv_1"}, "conversation", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "'item_reference'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "'input_image'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "call_id"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"top_logprobs": 21}, "top_logprobs", "20"),
    ({"max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format", "'name'"),
    ({"model": "other"}, "model", "not served"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"input": [{"role": "user", "content": None}]}, "input", "item 0 (message): 'content'"),
])
def test_errors_are_400s_naming_the_responses_field(srv, body, param, words):
    r = _post(srv, **body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert words in r.json()["error"]["message"], r.text


# -- without a server -------------------------------------------------------------------------------------
def test_text_after_a_call_is_a_second_message_in_a_stream_and_the_same_text():
    """The hermes parser's content around a call: a stream finishes the message before the call starts."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    stream = OutputItems()
    events = [e for d in ({"content": "Let me look."}, {"tool_calls": [call]}, {"content": "Done."})
              for e in stream.feed(d)] + stream.close("completed")
    assert [i["type"] for i in stream.items] == ["message", "function_call", "message"]
    whole = OutputItems()
    whole.feed({"content": "Let me look.Done.", "tool_calls": [call]})
    whole.close("completed")
    assert [i["type"] for i in whole.items] == ["message", "function_call"]
    texts = ["".join(p["text"] for i in items.items if i["type"] == "message" for p in i["content"])
             for items in (stream, whole)]
    assert texts[0] == texts[1] == "Let me look.Done."
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]
    assert events[-1]["item"]["status"] == "completed"


def test_a_failed_choice_ends_the_stream_with_an_error_and_response_failed():
    class FailingChoices:
        rid, created, model = "chatcmpl-abc", 1, "tiny"
        gens = [SimpleNamespace(req=SimpleNamespace(params=SimpleNamespace(temperature=0.0, top_p=1.0)))]

        async def sse(self):
            for chunk in ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                                        "finish_reason": None}]},
                          {"error": {"message": "the engine failed this request: boom", "type": "server_error",
                                     "param": None, "code": "engine_error"}}):
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

    async def run() -> list[dict]:
        out = ResponseOutput(FailingChoices(), parse_request({"input": "hi"}))
        return [json.loads(block.split("\ndata: ")[1]) async for block in out.sse()]

    events = asyncio.run(run())
    assert [e["type"] for e in events][-4:] == ["response.content_part.done", "response.output_item.done", "error",
                                                "response.failed"]
    assert events[-2]["code"] == "engine_error" and "boom" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["id"] == "resp_abc" and failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["status"] == "incomplete" and failed["output"][0]["content"][0]["text"] == "Hi"

"""Tool calling (scheduler/api_tools.py, scheduler/tool_calls.py, scheduler/chat_answer.py): the hermes parser's
split of an answer into content and calls (a stream's deltas add up to the whole answer), the tool_choice
modes over HTTP against a Qwen3-like template, and the openai SDK reading the calls."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.api_tools import MessageToolCall, ToolFieldError, ToolFields
from scheduler.chat_answer import ChatAnswer
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from scheduler.tool_calls import HermesToolParser, call_of
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _parse(text: str) -> tuple[str, list[tuple[str, str]]]:
    p = HermesToolParser()
    content, calls = p.feed(text)
    tail, more = p.flush()
    return content + tail, [(c.name, c.arguments) for c in calls + more]


@pytest.mark.parametrize("text, want", [
    ("Hello there.\n", ("Hello there.\n", [])),  # no call: the text exactly, its trailing whitespace too
    (CALL, ("", [("get_weather", '{"city": "Paris"}')])),
    ("Let me check.\n\n" + CALL + "\n", ("Let me check.", [("get_weather", '{"city": "Paris"}')])),
    (CALL + "\n" + CALL.replace("Paris", "Oslo"), ("", [("get_weather", '{"city": "Paris"}'),
                                                          ("get_weather", '{"city": "Oslo"}')])),
    (CALL + "\n\nDone.", ("Done.", [("get_weather", '{"city": "Paris"}')])),
    # text on both sides: joined by the whitespace the text before the calls ended with (regression: none, so
    # "Let me check.\n<call>\nDone." read "Let me check.Done.")
    ("Let me check.\n" + CALL + "\nDone.", ("Let me check.\nDone.", [("get_weather", '{"city": "Paris"}')])),
    ("A " + CALL + "\n" + CALL + "\n\nB", ("A B", [("get_weather", '{"city": "Paris"}')] * 2)),
    ("A" + CALL + "B", ("AB", [("get_weather", '{"city": "Paris"}')])),
    ("a <tool_call>not json</tool_call> b", ("a <tool_call>not json</tool_call> b", [])),  # text, nothing lost
    ('<tool_call>{"name": "f", "arguments": {}}', ("", [("f", "{}")])),  # left open, but whole JSON
    ('x <tool_call>{"name": "f", "argu', ('x <tool_call>{"name": "f", "argu', [])),  # cut off: text
    ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', ("", [("f", '{"a": 1}')])),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', ("", [("f", '{"a": 1}')])),
    ("<tool_ca", ("<tool_ca", [])),
    ("", ("", [])),
])
def test_whole_answers(text, want):
    assert _parse(text) == want


def test_what_a_block_must_hold_to_be_a_call():
    assert call_of('{"name": "f"}').arguments == "{}"
    for body in ('{"arguments": {}}', '{"name": ""}', '["f"]', '{"name": 3}', '{"name": "f", "arguments": [1]}', "{"):
        assert call_of(body) is None, body


PIECES = ["<tool_call>", "</tool_call>", "<", "</", "tool_", "call>", '{"name": "f"}', '{"name"', ': "g"}', "a",
          " ", "\n", "x</tool_call"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.data())
def test_any_deltas_add_up_to_the_whole_answer(pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    p = HermesToolParser()
    parts = [p.feed(d) for d in deltas] + [p.flush()]
    streamed = ("".join(c for c, _ in parts), [(c.name, c.arguments) for _, calls in parts for c in calls])
    assert streamed == _parse(text)
    if not streamed[1]:  # no call: the text as it was
        assert streamed[0] == text


def _streamed_message(answer: ChatAnswer, deltas: list[str]) -> tuple[str, list[dict]]:
    """A stream's content and its tool calls, accumulated as the openai SDK accumulates them."""
    content, calls = "", {}
    for i, d in enumerate(deltas):
        delta = answer.feed(d)
        if i == len(deltas) - 1:
            delta += answer.flush()
        content += delta.content
        for c in delta.calls:
            call = calls.setdefault(c["index"], {"id": c.get("id"), "name": "", "arguments": ""})
            call["name"] += c["function"].get("name") or ""
            call["arguments"] += c["function"].get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def test_a_named_calls_arguments_stream_as_they_come():
    answer = ChatAnswer(None, "named", "get_weather")
    content, calls = _streamed_message(answer, ['{"ci', 'ty": ', '"Paris"}'])
    whole = ChatAnswer(None, "named", "get_weather").whole('{"city": "Paris"}')
    assert (content, calls[0]["name"], calls[0]["arguments"]) == ("", "get_weather", '{"city": "Paris"}')
    assert whole[1] is None and whole[2][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert answer.finish_reason("stop") == "stop"  # (OpenAI's for a named function)


def test_a_required_list_is_its_calls_and_a_cut_off_one_is_text():
    answer = ChatAnswer(None, "required")
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    _, content, calls = answer.whole(text)
    assert content is None and [c["function"] for c in calls] == [{"name": "f", "arguments": '{"a": 1}'},
                                                                 {"name": "g", "arguments": "{}"}]
    assert answer.finish_reason("stop") == "tool_calls" and answer.finish_reason("length") == "length"
    cut = ChatAnswer(None, "required")
    assert cut.whole('[{"name": "f", "para') == (None, '[{"name": "f", "para', []) and cut.finish_reason("length")


def test_parallel_tool_calls_false_keeps_the_first_call():
    answer = ChatAnswer(None, "auto", single=True)
    _, content, calls = answer.whole(CALL + CALL.replace("Paris", "Oslo"))
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}']


def _fields(**kw) -> ToolFields:
    return ToolFields.model_validate(kw)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "today's weather",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
                   "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "additionalProperties": False, "$defs": {"zone": {"enum": ["utc", "cet"]}}}}}


def test_tool_modes_and_their_checks():
    assert _fields().tool_mode() == "none" and _fields(tool_choice="auto").tool_mode() == "none"
    assert _fields(tools=[WEATHER]).tool_mode() == "auto"
    assert _fields(tools=[WEATHER], tool_choice="none").tool_mode() == "none"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _fields(tools=[WEATHER], tool_choice=named).tool_mode() == "named"
    _fields(tools=[WEATHER], tool_choice="none").check_tools(auto_enabled=False)
    for kw, auto, param, words in [
        ({"tools": [WEATHER]}, False, "tool_choice", "--enable-auto-tool-choice"),
        ({"tool_choice": "required"}, True, "tool_choice", "needs 'tools'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, True,
         "tool_choice", "'nope'"),
        ({"tools": [WEATHER, WEATHER]}, True, "tools", "twice"),
    ]:
        with pytest.raises(ToolFieldError) as exc:
            _fields(**kw).check_tools(auto)
        assert exc.value.param == param and words in str(exc.value), kw


def test_a_required_choice_holds_the_answer_to_a_list_of_the_tools_calls():
    spec = _fields(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False).tool_spec()
    schema = json.loads(spec.value)
    assert schema["minItems"] == schema["maxItems"] == 1 and schema["$defs"] == {"zone": {"enum": ["utc", "cet"]}}
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]  # (lifted to the top)
    clash = {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"zone": {"type": "string"}}}}}
    with pytest.raises(ToolFieldError, match="differently"):
        _fields(tools=[CLOCK, clash], tool_choice="required").tool_spec()


def test_an_assistant_call_reaches_the_template_with_its_arguments_as_an_object():
    call = MessageToolCall.model_validate({"id": "c1", "type": "function",
                                           "function": {"name": "f", "arguments": '{"a": 1}'}})
    assert call.as_template_dict()["function"]["arguments"] == {"a": 1}
    odd = MessageToolCall.model_validate({"id": "c1", "function": {"name": "f", "arguments": "not json"}})
    assert odd.as_template_dict()["function"]["arguments"] == "not json"


# -- over HTTP --------------------------------------------------------------------------------------------
# Qwen3's template's tool parts, shortened: the tools listed in a system turn, an assistant's calls as
# <tool_call> blocks (arguments written with tojson), tool results in a user turn
TEMPLATE = (
    "{% if tools %}<system># Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}<assistant>")
HI = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), config={"chat_template": TEMPLATE})
    tokenizer = HFTokenizer(str(path))
    made = []
    for parser in ("hermes", None):
        engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=2048))
        limits = ServerLimits(shutdown_grace_s=1.0, tool_call_parser=parser)
        made.append(ServerThread(create_app(engine, limits, tokenizer=tokenizer)).__enter__())
    yield made
    for s in made:
        s.__exit__(None, None, None)


def _post(s, **body) -> httpx.Response:
    return httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 120, "temperature": 0, **body}, timeout=60)


def _ok(s, **body) -> dict:
    r = _post(s, **body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _stream(s, **body) -> tuple[str, list[dict], str]:
    body = {"messages": HI, "max_tokens": 120, "temperature": 0, "stream": True, **body}
    content, calls, finish = "", {}, None
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                content += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
                for c in choice["delta"].get("tool_calls", ()):
                    call = calls.setdefault(c["index"], {"id": c.get("id"), "name": "", "arguments": ""})
                    call["name"] += c["function"].get("name") or ""
                    call["arguments"] += c["function"].get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)], finish


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else "\\n" if ch == "\n" else ch for ch in text)


def test_auto_reads_the_calls_out_of_the_answer(servers):
    """The answer held (guided_regex) to a hermes call after some text: its content and its call, streamed
    alike; the server without a parser refuses "auto"."""
    parsed, plain = servers
    wanted = "Let me look.\n" + CALL
    choice = _ok(parsed, tools=[WEATHER], guided_regex=_regex(wanted))
    message = choice["message"]
    assert message["content"] == "Let me look." and choice["finish_reason"] == "tool_calls"
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    content, calls, finish = _stream(parsed, tools=[WEATHER], guided_regex=_regex(wanted))
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    r = _post(plain, tools=[WEATHER])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    # tool_choice "none": the tools are in the prompt, the answer is text
    with_tools = _ok(plain, tools=[WEATHER], tool_choice="none", guided_regex=_regex(CALL), max_tokens=200)
    assert with_tools["message"]["content"] == CALL and "tool_calls" not in with_tools["message"]
    assert with_tools["finish_reason"] == "stop"


def test_required_and_named_choices_hold_the_answer_to_calls(servers):
    parsed, plain = servers
    for s in (parsed, plain):  # (neither needs the parser: the answer's grammar makes it calls)
        choice = _ok(s, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False, seed=1,
                     temperature=1.0)
        [call] = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        args = json.loads(call["function"]["arguments"])
        assert (call["function"]["name"], args) in [("get_weather", {"unit": "c"}), ("get_weather", {"unit": "f"}),
                                                    ("get_time", {"zone": "utc"}), ("get_time", {"zone": "cet"})]
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = _ok(parsed, tools=[WEATHER, CLOCK], tool_choice=named)
    [call] = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "stop" and call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"])["zone"] in ("utc", "cet")
    content, calls, finish = _stream(parsed, tools=[WEATHER, CLOCK], tool_choice=named)
    assert (content, finish, calls[0]["name"]) == ("", "stop", "get_time")
    assert calls[0]["arguments"] == call["function"]["arguments"]  # (greedy: the same arguments)


def test_a_tool_choice_and_a_response_format_at_once_is_a_400(servers):
    r = _post(servers[0], tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert r.status_code == 400 and "both ask" in r.json()["error"]["message"], r.text


def test_tools_and_a_conversation_with_calls_reach_the_template(servers):
    parsed, _ = servers
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = httpx.post(parsed.url + "/tokenize", json={"messages": messages, "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.post(parsed.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60).json()["prompt"]
    assert text.startswith('<system># Tools\n{"type": "function", "function": {"name": "get_weather"')
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>' in text
    assert "<tool>sunny[call_1]" in text
    choice = _ok(parsed, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert choice["finish_reason"] == "length"
    r = _post(parsed, messages=[{"role": "user", "content": "x", "tool_calls": messages[1]["tool_calls"]}])
    assert r.status_code == 400 and "tool_calls" in r.json()["error"]["message"], r.text


def test_the_openai_sdk_reads_the_calls(servers):
    parsed, _ = servers
    client = openai.OpenAI(base_url=parsed.url + "/v1", api_key="none", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="tiny", messages=HI, tools=[WEATHER], tool_choice=named, max_tokens=60,
                                       temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] in ("c", "f")
    with client.chat.completions.stream(model="tiny", messages=HI, tools=[WEATHER], tool_choice=named,
                                        max_tokens=60, temperature=0) as stream:
        for _ in stream:
            pass
        streamed = stream.current_completion_snapshot.choices[0].message
    assert streamed.tool_calls[0].function.arguments == call.function.arguments
    # the message sent back, as a conversation goes on
    follow = client.chat.completions.create(model="tiny", max_tokens=2, tools=[WEATHER], tool_choice="none",
                                            messages=[*HI, r.choices[0].message, {"role": "tool", "content": "ok",
                                                                                  "tool_call_id": call.id}])
    assert follow.usage.completion_tokens == 2


def test_a_large_grammar_compiles_off_the_event_loop(servers, monkeypatch):
    """A required tool_choice over many tools (or a large schema) compiles its grammar in a worker thread
    (regression: on the loop, ~0.3 s per 1,000 tools, every stream held meanwhile): the first Guides.check of
    the spec runs on a thread other than the server loop's, and the request is served."""
    import threading

    parsed, _ = servers
    guides = parsed.app.state.hc.engine.guides
    threads, check = [], guides.check

    def recording(spec):
        threads.append(threading.current_thread())
        return check(spec)

    monkeypatch.setattr(guides, "check", recording)
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": WEATHER["function"]["parameters"]}}
             for i in range(8)]
    choice = _ok(parsed, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    assert choice["message"]["tool_calls"]
    assert threads and threads[0] is not parsed.thread

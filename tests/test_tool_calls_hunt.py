"""A hunt over tool calling (scheduler/api_tools.py, scheduler/tool_calls.py, scheduler/chat_answer.py,
scheduler/choices.py): the hermes parser on adversarial answers, a Qwen3-shaped template rendered with tools and
a conversation of calls, and the HTTP server (hermes + --reasoning-parser qwen3) with n, streams, stop strings,
logprobs, odd tools and the openai SDK. Regressions first, then behaviours checked correct."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.api_inputs import chat_ids
from scheduler.api_models import ChatCompletionRequest
from scheduler.api_tools import ToolFields
from scheduler.chat_answer import ChatAnswer
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.reasoning import ReasoningSplitter
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from scheduler.tool_calls import HermesToolParser
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer


def _parse(text: str, step: int = 0) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of an answer fed whole (step 0) or in deltas of `step` characters."""
    p = HermesToolParser()
    deltas = [text] if not step else [text[i:i + step] for i in range(0, len(text), step)]
    parts = [p.feed(d) for d in deltas] + [p.flush()]
    return "".join(c for c, _ in parts), [(c.name, c.arguments) for _, calls in parts for c in calls]


def _all_ways(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The answer parsed whole, and in deltas of 1, 2, 3, 5 and 7 characters: all alike (a stream adds up)."""
    whole = _parse(text)
    for step in (1, 2, 3, 5, 7):
        assert _parse(text, step) == whole, step
    return whole


# -- the hermes parser ----------------------------------------------------------------------------------------
CODE_ARGS = {"path": "t.py", "code": "print('</tool_call>')"}
CODE_CALL = "<tool_call>\n" + json.dumps({"name": "write", "arguments": CODE_ARGS}) + "\n</tool_call>"


def test_a_call_whose_arguments_hold_the_end_marker_is_a_call():
    """A "</tool_call>" inside a string of the call's JSON is its text, not the block's end (regression: the
    block ended there, its body was no JSON, and the whole call came back as content with finish "stop"; an agent
    writing code or docs about tool calls hits it). vLLM's regex ends the block at the first marker too."""
    assert _all_ways(CODE_CALL) == ("", [("write", json.dumps(CODE_ARGS))])
    escaped = {"s": 'a \\" </tool_call> " \\\\'}  # (escaped quotes and backslashes around it)
    text = "Writing.\n" + "<tool_call>" + json.dumps({"name": "f", "arguments": escaped}) + "</tool_call>\nDone."
    # (the space around a call dropped, the text after it joined by the line break the text before it ended with)
    assert _all_ways(text) == ("Writing.\nDone.", [("f", json.dumps(escaped))])
    two = CODE_CALL + "\n" + CODE_CALL
    assert _all_ways(two) == ("", [("write", json.dumps(CODE_ARGS))] * 2)
    left_open = "<tool_call>" + json.dumps({"name": "write", "arguments": CODE_ARGS})  # (max_tokens, whole JSON)
    assert _all_ways(left_open) == ("", [("write", json.dumps(CODE_ARGS))])


def test_a_broken_block_still_ends_at_its_first_marker():
    """What the marker-in-a-string rule must not change: a body that is no call (an unclosed string) ends where
    it did, as text, and the calls after it are still read."""
    broken = '<tool_call>{"name": "f", "arguments": {"a": "x}}</tool_call>'
    good = '<tool_call>{"name": "g", "arguments": {"b": 1}}</tool_call>'
    assert _all_ways(broken + "\n" + good) == (broken, [("g", '{"b": 1}')])
    assert _all_ways(broken + " tail") == (broken + " tail", [])  # (left open at the end: text, nothing lost)
    # (read again once an answer, so no text is read more than twice: a second such block is text through its end)
    twice = broken + "\n" + good + "\n" + broken + "\n" + good
    assert _all_ways(twice) == (broken + "\n" + broken + "\n" + good, [("g", '{"b": 1}')])
    assert _all_ways('a <tool_call>say "hi</tool_call> b') == ('a <tool_call>say "hi</tool_call> b', [])
    # a backslash outside a string hides no marker
    assert _all_ways('<tool_call>{\\</tool_call>x') == ('<tool_call>{\\</tool_call>x', [])


def test_a_long_body_is_read_in_linear_time():
    """A 200 KB call in 1-character deltas (a byte-level tokenizer's): its body was grown and searched whole at
    each delta, 200 K times (~6 s of the event loop; now well under a second); a required list's text likewise
    grew by copies. No timing asserted."""
    args = {"text": "x" * 200_000}
    text = "<tool_call>\n" + json.dumps({"name": "save", "arguments": args}) + "\n</tool_call>"
    assert _parse(text, 1) == ("", [("save", json.dumps(args))])
    answer, text = ChatAnswer(None, "required"), json.dumps([{"name": "save", "parameters": args}])
    assert not any(answer.feed(ch).calls for ch in text) and answer.flush().calls[0]["function"]["name"] == "save"
    # blocks that each run on past a marker in a string to the answer's end: each text read at most twice
    unit = '<tool_call>{"a":"</tool_call>"}'
    assert _parse(unit * 3000, 4) == _parse(unit * 3000) == (unit * 3000, [])


PIECES = ["<tool_call>", "</tool_call>", "</tool", "_call>", '{"name": "f", "arguments": {"a": "', '"}}', '"', "\\",
          '\\"', "{", "}", " ", "\n", "x", "<"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.data())
def test_any_deltas_add_up_with_strings_and_escapes_in_the_bodies(pieces, data):
    """The marker-in-a-string rule keeps a stream's deltas adding up to the whole answer, and an answer without
    calls its text exactly."""
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    p = HermesToolParser()
    parts = [p.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [p.flush()]
    streamed = ("".join(c for c, _ in parts), [(c.name, c.arguments) for _, calls in parts for c in calls])
    assert streamed == _parse(text)
    if not streamed[1]:
        assert streamed[0] == text


@pytest.mark.parametrize("text, want", [
    ('<tool_call>{"name": "f", "arguments": {"a": "<tool_call>"}}</tool_call>', ("", [("f", '{"a": "<tool_call>"}')])),
    ('<tool_call>{"name": "f", "arguments": {"a": {"b": [1, {"c": "}{"}]}}}</tool_call>',
     ("", [("f", '{"a": {"b": [1, {"c": "}{"}]}}')])),
    ('<tool_call>{"name": "météo", "arguments": {"ville": "Zürich ☃"}}</tool_call>',
     ("", [("météo", '{"ville": "Zürich ☃"}')])),
    ("  \n", ("  \n", [])),  # whitespace alone: kept exactly
    ("a\n\n<tool_call>not json</tool_call>\n\nb\n", ("a\n\n<tool_call>not json</tool_call>\n\nb\n", [])),
    ('<tool_call> {"name": "f"} </tool_call>', ("", [("f", "{}")])),
    ("<tool_call></tool_call>", ("<tool_call></tool_call>", [])),
    ('<tool_call>{"name": "f"}</tool_call></tool_call>', ("</tool_call>", [("f", "{}")])),
])
def test_odd_answers(text, want):
    assert _all_ways(text) == want


# -- a Qwen3-shaped chat template -----------------------------------------------------------------------------
# Qwen3's tool and thinking parts, as its tokenizer_config.json writes them (written here from the format; a
# few of its nested ifs joined, and lines packed: its whitespace control makes the layout no part of the text)
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> XML tags<|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or (not loop.last and reasoning_content)) %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}{{- '\n' }}{%- endif %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- content }}{{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather <in> a city & \"its\" région",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS_TURN = ("<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou are provided with function signatures within "
              "<tools></tools> XML tags:\n<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n"  # (tojson)
              + json.dumps(CLOCK, ensure_ascii=False) + "\n</tools>\n\nFor each function call, return a json object "
              "within <tool_call></tool_call> XML tags<|im_end|>\n")


def _call(cid: str, name: str, arguments: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_byte_tokenizer(tmp_path_factory.mktemp("qwen3"), config={"chat_template": QWEN3})


def _rendered(tokenizer: HFTokenizer, body: dict) -> str:
    return tokenizer.decode(chat_ids(ChatCompletionRequest.model_validate(body), tokenizer))


def test_a_qwen3_template_renders_tools_and_a_conversation_of_calls_as_transformers_would(qwen3_dir):
    """Every part a Qwen3 conversation with tools goes through, against the text written out by hand from the
    template (what transformers renders for the same messages, their arguments as objects): the tools' tojson
    lines (no HTML escaping, non-ASCII kept), an assistant's calls after its text, the namespace loop's last
    query (a thought kept only after it), consecutive tool results in one user turn, enable_thinking false."""
    tokenizer = HFTokenizer(str(qwen3_dir))
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Zürich, and the time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            _call("c1", "get_weather", '{"city": "Zürich"}'), _call("c2", "get_time", '{"zone":"cet"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "assistant", "content": "<think>\nBoth came back.\n</think>\n\nSunny, noon."},
        {"role": "user", "content": "And Oslo?"},
        {"role": "assistant", "content": "<think>\nAnother call.\n</think>\n\nChecking.",
         "tool_calls": [_call("c3", "get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "c3", "content": "rain"},
    ]
    want = (TOOLS_TURN
            + "<|im_start|>user\nWeather in Zürich, and the time?<|im_end|>\n"
            + '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call><|im_end|>\n'
            + "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n12:00\n"
              "</tool_response><|im_end|>\n"
            + "<|im_start|>assistant\nSunny, noon.<|im_end|>\n"  # (before the last query: its thought dropped)
            + "<|im_start|>user\nAnd Oslo?<|im_end|>\n"
            + '<|im_start|>assistant\n<think>\nAnother call.\n</think>\n\nChecking.\n<tool_call>\n{"name": '
              '"get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
            + "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
            + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    got = _rendered(tokenizer, {"messages": messages, "tools": [WEATHER, CLOCK],
                                "chat_template_kwargs": {"enable_thinking": False}})
    assert got == want and 'Today\'s weather <in> a city & \\"its\\" région' in got  # (not HTML-escaped)
    # no tools: the system message alone; arguments that are no JSON object go in as they are
    odd = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
           {"role": "assistant", "content": "t", "tool_calls": [_call("c", "f", "not json"), _call("d", "g", "[1]")]}]
    assert _rendered(tokenizer, {"messages": odd, "add_generation_prompt": False}) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>"
        '\n\nt\n<tool_call>\n{"name": "f", "arguments": not json}\n</tool_call>\n<tool_call>\n{"name": "g", '
        '"arguments": [1]}\n</tool_call><|im_end|>\n')


# -- over HTTP: hermes and --reasoning-parser qwen3 -------------------------------------------------------------
HI = [{"role": "user", "content": "weather?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT_CALL, ARGS = "<think>\nI should call.\n</think>\n\n" + CALL, '{"city": "Paris"}'


@pytest.fixture(scope="module")
def srv(qwen3_dir):
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=4096))
    limits = ServerLimits(shutdown_grace_s=1.0, tool_call_parser="hermes", reasoning_parser="qwen3")
    with ServerThread(create_app(engine, limits, tokenizer=HFTokenizer(str(qwen3_dir)))) as s:
        yield s


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else "\\n" if ch == "\n" else ch for ch in text)


def _post(s, **body) -> httpx.Response:
    body = {"messages": HI, "tools": [WEATHER], "max_tokens": 120, "temperature": 0, **body}
    return httpx.post(s.url + "/v1/chat/completions", content=json.dumps(body), timeout=60,  # (ASCII: "\ud800" too)
                      headers={"content-type": "application/json"})


def _ok(s, **body) -> dict:
    r = _post(s, **body)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(s, **body) -> tuple[list[dict], list[dict]]:
    """(each choice's stream added up in a whole response's message shape, the chunks)."""
    body = {"messages": HI, "tools": [WEATHER], "max_tokens": 120, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            o = out.setdefault(c["index"], {"reasoning_content": "", "content": "", "calls": {}, "finish_reason": None,
                                            "token_ids": [], "logprobs": []})
            for key in ("reasoning_content", "content"):
                o[key] += c["delta"].get(key) or ""
            o["finish_reason"], o["token_ids"] = c["finish_reason"] or o["finish_reason"], o["token_ids"] + c["token_ids"]
            o["logprobs"] += (c["logprobs"] or {}).get("content", [])
            for d in c["delta"].get("tool_calls", ()):
                call = o["calls"].setdefault(d["index"], {"id": d.get("id"), "type": d.get("type"), "function": {}})
                for key in ("name", "arguments"):
                    call["function"][key] = call["function"].get(key, "") + (d["function"].get(key) or "")
    for o in out.values():
        o["calls"] = [o["calls"][i] for i in sorted(o["calls"])]
    return [out[i] for i in sorted(out)], chunks


def _same_message(whole_choice: dict, streamed: dict) -> None:
    """A whole response's choice and its stream added up are one message (the call ids aside: each request's)."""
    message = whole_choice["message"]
    assert (message.get("reasoning_content") or "") == streamed["reasoning_content"]
    assert (message["content"] or "") == streamed["content"]
    strip = lambda calls: [{**c, "id": None} for c in calls]  # noqa: E731
    assert strip(message.get("tool_calls") or []) == strip(streamed["calls"])
    assert whole_choice["finish_reason"] == streamed["finish_reason"]
    assert whole_choice["token_ids"] == streamed["token_ids"]


def test_a_guided_answer_that_thinks_first_is_split(srv):
    """guided_regex made the answer think, then call (tool_choice auto): the thought is reasoning_content and the
    call a call, as an answer the model made alone is read (regression: a guided answer was never split, so the
    think block came back as content, markers and all, next to the call). Stream and whole alike."""
    whole = _ok(srv, guided_regex=_regex(THOUGHT_CALL))["choices"][0]
    message = whole["message"]
    assert message["reasoning_content"] == "\nI should call.\n" and message["content"] is None, message
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather",
                                                               "arguments": '{"city": "Paris"}'}]
    assert whole["finish_reason"] == "tool_calls"
    [streamed], _ = _streamed(srv, guided_regex=_regex(THOUGHT_CALL))
    _same_message(whole, streamed)
    # the parser's regression through a server: a call whose arguments hold "</tool_call>", finish "tool_calls"
    whole = _ok(srv, guided_regex=_regex(CODE_CALL), max_tokens=200)["choices"][0]
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == CODE_ARGS
    _same_message(whole, _streamed(srv, guided_regex=_regex(CODE_CALL), max_tokens=200)[0][0])
    # one that does not think is all content, even after a prompt that opened a think block
    plain = _ok(srv, guided_regex="[a-z]{4}", messages=[*HI, {"role": "assistant", "content": "<think>\nhm"}],
                continue_final_message=True, add_generation_prompt=False)["choices"][0]["message"]
    assert plain["reasoning_content"] is None and len(plain["content"]) == 4, plain


def test_n_choices_each_make_their_own_calls(srv):
    """n = 3: each choice its calls (ids of their own, indexes from 0 in each choice's stream), the stream adding
    up to the whole response per choice, with logprobs and stream_options' usage chunk; parallel_tool_calls false."""
    two = CALL + "\n" + CALL.replace("Paris", "Oslo")
    body = dict(guided_regex=_regex(two), n=3, logprobs=True, top_logprobs=1, max_tokens=200)
    whole = _ok(srv, **body)
    ids = [c["id"] for ch in whole["choices"] for c in ch["message"]["tool_calls"]]
    assert len(set(ids)) == 6 and [ch["index"] for ch in whole["choices"]] == [0, 1, 2]
    streamed, chunks = _streamed(srv, stream_options={"include_usage": True}, **body)
    assert len(streamed) == 3
    for w, s in zip(whole["choices"], streamed):
        _same_message(w, s)
        assert [c["function"]["arguments"] for c in s["calls"]] == ['{"city": "Paris"}', '{"city": "Oslo"}']
        assert len(s["logprobs"]) == len(w["logprobs"]["content"]) == len(s["token_ids"])
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 3 * len(streamed[0]["token_ids"])
    assert whole["usage"]["completion_tokens"] == usage["completion_tokens"]
    # parallel_tool_calls false: the first call alone, streamed as index 0
    body.update(n=1, parallel_tool_calls=False)
    [streamed], chunks = _streamed(srv, **body)
    _same_message(_ok(srv, **body)["choices"][0], streamed)
    assert [c["function"]["arguments"] for c in streamed["calls"]] == ['{"city": "Paris"}']
    assert [d["index"] for ch in chunks for c in ch["choices"] for d in c["delta"].get("tool_calls", ())] == [0]


def test_named_and_required_choices_with_n_and_a_reasoning_parser(srv):
    """Grammar-held answers now pass the reasoning split too (it finds no think block in them): a named call's
    stream still names it first, per choice, and adds up to the whole response; a required list likewise."""
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in (named, "required"):
        body = dict(tools=[WEATHER, CLOCK], tool_choice=choice, n=2, seed=5, temperature=1.0, max_tokens=60)
        whole = _ok(srv, **body)
        streamed, chunks = _streamed(srv, **body)
        for w, st_ in zip(whole["choices"], streamed):
            _same_message(w, st_)
            assert "reasoning_content" in w["message"] and w["message"]["reasoning_content"] is None
        first = [c for ch in chunks for c in ch["choices"] if c["delta"].get("tool_calls")]
        if choice is named:
            assert [c["delta"]["tool_calls"][0]["function"]["name"] for c in first[:2]] == ["get_time"] * 2
            assert {c["index"] for c in first[:2]} == {0, 1}


def test_a_thought_about_calling_is_no_call():
    """The calls are read after the reasoning split: markup in the thought stays there."""
    reasoning, content, calls = ChatAnswer(ReasoningSplitter(), "auto").whole("<think>" + CODE_CALL + "</think>" + CALL)
    assert (reasoning, content, [c["function"]["name"] for c in calls]) == (CODE_CALL, None, ["get_weather"])


@pytest.mark.parametrize("body, content, calls, finish", [
    # a stop string that ends the block: the call is whole either way
    ({"stop": ["</tool_call>"]}, "Let me look.", 1, "tool_calls"),
    ({"stop": ["</tool_call>"], "include_stop_str_in_output": True}, "Let me look.", 1, "tool_calls"),
    # one before the block: text as it was, no call
    ({"stop": ["<tool_call>"]}, "Let me look.\n", 0, "stop"),
    # one inside the call: its body cut off, text
    ({"stop": ["Paris"]}, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "', 0, "stop"),
    # max_tokens in the middle of the call: text, "length"
    ({"max_tokens": 30}, 'Let me look.\n<tool_call>\n{"nam', 0, "length"),
])
def test_stop_strings_and_max_tokens_around_a_call(srv, body, content, calls, finish):
    guided = _regex("Let me look.\n" + CALL)
    whole = _ok(srv, guided_regex=guided, **body)["choices"][0]
    message = whole["message"]
    assert (message["content"], len(message.get("tool_calls") or []), whole["finish_reason"]) == (content, calls,
                                                                                                   finish), message
    [streamed], _ = _streamed(srv, guided_regex=guided, **body)
    _same_message(whole, streamed)


def test_odd_tools_and_tool_choices(srv):
    """A named function without parameters, an odd name, parameters llguidance cannot compile (a 400
    naming tools, whose parameters they are, not a 500), lone surrogates (400s), echo (no field of a chat)."""
    bare = {"type": "function", "function": {"name": "ping"}}
    odd = {"type": "function", "function": {"name": 'we ird/"name\\ é', "parameters": {"type": "object"}}}
    for tool in (bare, odd):
        name = tool["function"]["name"]
        whole = _ok(srv, tools=[WEATHER, tool], tool_choice={"type": "function", "function": {"name": name}},
                    max_tokens=8)["choices"][0]
        assert whole["message"]["tool_calls"][0]["function"]["name"] == name and whole["message"]["content"] is None
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}}
    for choice in ("required", {"type": "function", "function": {"name": "bad"}}):
        r = _post(srv, tools=[bad], tool_choice=choice)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    surrogate = {"type": "function", "function": {"name": "f", "description": "\ud800"}}
    call = {"role": "assistant", "content": None, "tool_calls": [_call("c1", "f", '{"a": "\\ud800"}')]}
    for body, param in (({"tools": [surrogate]}, "tools"), ({"messages": [*HI, call], "tool_choice": "none"}, "messages"),
                        ({"tools": [{"type": "function", "function": {"name": "\ud800"}}], "tool_choice": "required"},
                         "tools")):
        r = _post(srv, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text  # (tools' was 'messages')
    r = _post(srv, echo=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


def test_a_required_choice_keeps_a_tools_own_references(srv):
    """A tool's parameters that refer into themselves other than through "$defs" (draft-07's "definitions", as
    pydantic v1 and many generators write them; a "#/properties/..." pointer; "#", the schema itself) compile in a
    required list, where the parameters sit inside the list's schema (regression: a 400 "Pointer
    '/definitions/...' does not exist" for a valid tool, which a named choice of it served)."""
    unit = {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "definitions": {"unit": {"enum": ["c", "f"]}},
        "properties": {"to": {"$ref": "#/definitions/unit"}, "from": {"$ref": "#/properties/to"},
                       "default": {"$ref": "#/definitions/unit"}},  # (a property named as a keyword)
        "required": ["to", "from"], "additionalProperties": False}}}
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "maxItems": 0, "items": {"$ref": "#"}}},
        "required": ["kids"], "additionalProperties": False}}}
    for tools in ([unit], [WEATHER, unit, tree]):
        whole = _ok(srv, tools=tools, tool_choice="required", max_tokens=80, temperature=1.0, seed=2)["choices"][0]
        assert whole["finish_reason"] in ("tool_calls", "length"), whole
        for call in whole["message"].get("tool_calls") or ():
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "convert":
                assert args["to"] in ("c", "f") and args["from"] in ("c", "f"), args
    spec = ToolFields.model_validate({"tools": [WEATHER, unit], "tool_choice": "required"}).tool_spec()
    params = json.loads(spec.value)["items"]["anyOf"][1]["properties"]["parameters"]
    at = "#/items/anyOf/1/properties/parameters"
    assert params["properties"]["to"] == {"$ref": at + "/definitions/unit"}
    assert params["properties"]["from"] == {"$ref": at + "/properties/to"}
    assert params["properties"]["default"] == {"$ref": at + "/definitions/unit"}


def test_the_openai_sdk_reads_auto_calls_and_sends_its_messages_back(srv):
    """The SDK's whole and streamed messages (its stream helper's snapshot too) of an auto call, each sent back in
    a follow-up with the tool's result, as an agent loop does."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    kw = dict(model="tiny", messages=HI, tools=[WEATHER], max_tokens=120, temperature=0,
              extra_body={"guided_regex": _regex("Let me look.\n" + CALL)})
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Let me look."
    [call] = message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGS)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [(0, "get_weather", ARGS)]
    with client.chat.completions.stream(**kw) as stream:
        snapshot = stream.get_final_completion().choices[0].message
    assert snapshot.tool_calls[0].function.arguments == call.function.arguments
    # (regression: the stream helper's calls carry its `index` and `parsed_arguments`: a 400 "unknown field")
    for sent in (snapshot, snapshot.model_dump(), snapshot.model_dump(exclude_none=True),
                 message.model_dump(exclude_none=True)):
        _follow_up(client, sent, call.id)


def _follow_up(client, sent, call_id: str) -> None:
    tool = {"role": "tool", "tool_call_id": call_id, "content": "sunny"}
    follow = client.chat.completions.create(model="tiny", max_tokens=2, tools=[WEATHER], tool_choice="none",
                                            messages=[*HI, sent, tool])
    assert follow.usage.completion_tokens == 2


def test_the_sdks_whole_message_goes_back_from_a_reasoning_server(srv):
    """The message of a whole response carries "reasoning_content": null (the server's own key, with
    --reasoning-parser), which the SDK keeps and sends back: 400 "unknown field 'messages.1.reasoning_content'"
    (vLLM takes it: Qwen3's template reads an assistant's reasoning_content)."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=HI, tools=[WEATHER], max_tokens=120, temperature=0,
                                       extra_body={"guided_regex": _regex(CALL)})
    _follow_up(client, r.choices[0].message, r.choices[0].message.tool_calls[0].id)

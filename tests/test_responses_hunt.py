"""A hunt over /v1/responses (scheduler/api_responses.py, scheduler/responses_output.py): what the openai SDK and
stateless agents (the OpenAI Agents SDK, Codex) send, lone surrogates, odd items, the limits' names, every streamed
event checked against the SDK's types and the API's invariants, clients that leave, 429s, and an engine failure
mid-stream. Regressions first, then behaviours checked correct."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from scheduler.api_models import APIError
from scheduler.api_responses import ResponsesShape, parse_request
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_responses_api import CLOCK, TEMPLATE, WEATHER
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

NAMED = {"type": "function", "name": "get_weather"}
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), added=("<think>", "</think>"),
                                config={"chat_template": TEMPLATE})
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=2048))
    limits = ServerLimits(shutdown_grace_s=1.0, tool_call_parser="hermes", reasoning_parser="qwen3",
                          max_concurrent_requests=2)
    with ServerThread(create_app(engine, limits, tokenizer=HFTokenizer(str(path)))) as s:
        s.engine = engine
        yield s


def _post(srv, **body) -> httpx.Response:
    """A /v1/responses body sent as JSON with its non-ASCII escaped (lone surrogates travel as "\\ud800")."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 1, **body}
    return httpx.post(srv.url + "/v1/responses", content=json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=60)


def _status(srv) -> dict:
    return httpx.get(srv.url + "/hicache/status").json()


def _idle(srv) -> dict:
    """The status once no request runs, waits or holds a slot (a stream's slot is freed after its last byte)."""
    deadline = time.monotonic() + 30
    while True:
        st = _status(srv)
        eng = st["engine"]
        if eng["running"] + eng["waiting"] + st["server"]["in_flight"] == 0:
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.02)


def _events(srv, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + "/v1/responses", json={"model": "tiny", **body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        blocks = r.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        event, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert event == "event: " + events[-1]["type"]
    return events


def check_events(events: list[dict]) -> dict:
    """A stream's events as OpenAI's: each one the SDK's type (validated, not merely constructed), numbered from 0,
    created and in_progress first (a background response's created and queued, its Response queued, then
    in_progress) and one terminal event last; each item added, written and done before the next, at its
    output_index, its events naming it; the final response's output: the items done, their text the deltas'.
    Returns the final response."""
    for e in events:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    head = events[0]["response"]
    queued = ["response.queued"] if head["background"] else []
    lead = ["response.created", *queued, "response.in_progress"]
    assert types[:len(lead)] == lead and not set(lead) & set(types[len(lead):]), types
    terminal = ("response.completed", "response.incomplete", "response.failed")
    assert types[-1] in terminal and sum(t in terminal for t in types) == 1
    statuses = [e["response"]["status"] for e in events[:len(lead)]]
    assert statuses == ["queued" if queued else "in_progress"] * (len(lead) - 1) + ["in_progress"], statuses
    assert head["output"] == [] and all(e["response"]["id"] == head["id"] for e in events[:len(lead)])
    done, item, text = [], None, ""
    for e in events[len(lead):-1]:
        kind = e["type"]
        if kind == "error":
            assert item is None and types[-1] == "response.failed"
            continue
        if kind == "response.output_item.added":
            assert item is None and e["output_index"] == len(done) and e["item"]["status"] == "in_progress"
            item, text = e["item"], ""
            continue
        assert item is not None, kind
        if kind == "response.output_item.done":
            assert e["output_index"] == len(done) and e["item"]["id"] == item["id"]
            assert e["item"]["type"] == item["type"] and e["item"]["status"] in ("completed", "incomplete")
            written = e["item"]["arguments"] if item["type"] == "function_call" else e["item"]["content"][0]["text"]
            assert written == text
            done.append(e["item"])
            item = None
            continue
        assert e["item_id"] == item["id"] and e["output_index"] == len(done), e
        assert e.get("content_index", 0) == 0
        if kind.endswith(".delta"):
            text += e["delta"]
        elif kind.endswith(".done") and "part" not in kind:
            assert e.get("text", e.get("arguments")) == text
    assert item is None
    final = events[-1]["response"]
    Response.model_validate(final)
    assert final["id"] == head["id"] and final["output"] == done
    if types[-1] != "response.failed":
        assert final["status"] == types[-1].removeprefix("response.") and final["usage"]["output_tokens"] >= 1
    return final


# -- regressions ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"metadata": {"k": "\ud800"}}, "metadata.k"),
    ({"metadata": {"\udfff": "v"}}, "metadata"),
    ({"user": "a\ud800b"}, "user"),
    ({"reasoning": {"effort": "\ud800"}}, "reasoning"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                          "description": "\ud800"}}}, "text"),
    ({"instructions": "\ud800"}, "instructions"),
    ({"input": [{"role": "user", "content": "ok"}, {"role": "user", "content": [{"type": "input_text",
                                                                               "text": "\ud800"}]}]}, "input"),
    ({"input": "\ud800", "stream": True}, "input"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(srv, body, param):
    """JSON carries lone surrogates, UTF-8 does not: one in a field the Response echoes (metadata, user, reasoning,
    text) failed its rendering after the answer was generated, a 500 (regression); one in `instructions` was
    blamed on 'input', in a message saying 'the messages' (regression)."""
    r = _post(srv, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and "messages" not in err["message"], err


@pytest.mark.parametrize("kind", [["message"], {"a": 1}, 5])
def test_an_item_whose_type_is_no_string_is_a_400(srv, kind):
    """An input item's `type` a list or an object: a TypeError ('unhashable type'), a 500 (regression)."""
    r = _post(srv, input=[{"type": kind, "role": "user", "content": "x"}])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and "item 0" in err["message"] and "type" in err["message"], err


def test_an_item_whose_type_is_null_is_a_message(srv):
    """`"type": null` on a message (optional there; clients that dump every field send it): null takes its
    default, as elsewhere in this API (it was 'Unable to extract tag using discriminator', item '?')."""
    r = _post(srv, input=[{"type": None, "role": "user", "content": "hi"}])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == _post(srv).json()["usage"]["input_tokens"]


def test_what_stateless_agents_send_is_served(srv, client):
    """Codex (store false) asks for `include: ["reasoning.encrypted_content"]` and sends `prompt_cache_key`; the
    Agents SDK sends `text.verbosity`, `prompt_cache_retention`; the openai SDK takes `stream_options`,
    `safety_identifier`, `max_tool_calls` (a bound on built-in tools' calls: this server has none). Each was a 400
    (regression): none changes what is generated (reasoning items carry their text; the prefix cache finds shared
    prefixes itself), and the Response echoes them."""
    kw = dict(model="tiny", input="hello", max_output_tokens=3, temperature=0, store=False,
              include=["reasoning.encrypted_content"], prompt_cache_key="session-1", prompt_cache_retention="24h",
              safety_identifier="user-1", max_tool_calls=4, text={"verbosity": "low"}, tools=[WEATHER],
              parallel_tool_calls=True, tool_choice="auto", reasoning={"effort": "low", "summary": "auto"})
    r = client.responses.create(**kw)
    plain = client.responses.create(model="tiny", input="hello", max_output_tokens=3, temperature=0,
                                    tools=[WEATHER])
    assert r.output_text == plain.output_text and r.usage.input_tokens == plain.usage.input_tokens
    assert (r.text.verbosity, r.text.format.type, r.max_tool_calls) == ("low", "text", 4)
    assert (r.prompt_cache_key, r.safety_identifier, r.prompt_cache_retention) == ("session-1", "user-1", "24h")
    with client.responses.stream(**{**kw, "text": {"format": {"type": "text"}, "verbosity": "high"}},
                                 stream_options={"include_obfuscation": False}) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.text.verbosity == "high"
    for body, param in (({"include": ["file_search_call.results"]}, "include"),
                        ({"text": {"verbosity": "loud"}}, "text.verbosity"), ({"max_tool_calls": -1}, "max_tool_calls"),
                        ({"stream_options": {"include_usage": True}}, "stream_options.include_usage")):
        bad = _post(srv, **body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_an_engine_refusal_of_the_output_length_names_max_output_tokens(srv):
    """The engine's refusal of prompt + max tokens (the L1 pool) named 'max_tokens', a field a Responses body
    has not (regression)."""
    r = _post(srv, max_output_tokens=2040)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_output_tokens" and "max_output_tokens (2040)" in err["message"], err
    assert "max_tokens" not in err["message"], err


def test_named_errors_rename_fields_not_words():
    """The renaming touches field names only: 'max_tokens' words and quoted chat fields, not a word that holds
    one ('max_tokens_limit', '--max-tokens-limit'). (Those of the chat path it was translated to: its body parsed.)"""
    shape = ResponsesShape()
    shape.chat_body({"input": "x"})
    with pytest.raises(APIError) as info, shape.named_errors():
        raise APIError(400, "max_tokens (9) over --max-tokens-limit; 'messages' and 'max_completion_tokens', "
                            "max_tokens_limit", param="max_completion_tokens")
    assert info.value.message == ("max_output_tokens (9) over --max-tokens-limit; 'input' and 'max_output_tokens', "
                                  "max_tokens_limit")
    assert info.value.param == "max_output_tokens"


# -- the event stream and the SDK's types --------------------------------------------------------------------------
@pytest.mark.parametrize("body", [
    {"input": "hello", "max_output_tokens": 5},
    {"input": "hi", "instructions": "think", "max_output_tokens": 5, "reasoning": {"effort": "low"}},
    {"input": "weather?", "tools": [WEATHER, CLOCK], "tool_choice": NAMED, "max_output_tokens": 40},
    {"input": "weather?", "tools": [WEATHER], "tool_choice": NAMED, "max_output_tokens": 4},  # (a call cut short)
    {"input": "json", "text": {"format": {"type": "json_object"}}, "max_output_tokens": 10},
], ids=["text", "reasoning", "call", "cut_call", "json"])
def test_every_stream_keeps_the_api_s_invariants_and_adds_up_to_the_whole_response(srv, body):
    body = {**body, "temperature": 0}
    final = check_events(_events(srv, body))
    whole = _post(srv, **body).json()
    Response.model_validate(whole)
    strip = lambda output: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in output]  # noqa: E731
    uncached = lambda usage: {**usage, "input_tokens_details": None}  # noqa: E731 (the second one hits the cache)
    assert strip(final["output"]) == strip(whole["output"]) and uncached(final["usage"]) == uncached(whole["usage"])
    assert final["status"] == whole["status"] and final["incomplete_details"] == whole["incomplete_details"]
    if whole["output"][-1]["type"] == "function_call" and whole["status"] == "incomplete":
        assert whole["output"][-1]["status"] == "incomplete"  # (its arguments cut: no JSON)


def test_the_sdk_parses_a_text_format_whole_and_streamed(client):
    from typing import Literal

    from pydantic import BaseModel

    class Pick(BaseModel):
        a: Literal["x", "y"]

    r = client.responses.parse(model="tiny", input="json", text_format=Pick, max_output_tokens=30, temperature=0)
    assert r.status == "completed" and r.output_parsed.a in ("x", "y")
    with client.responses.stream(model="tiny", input="json", text_format=Pick, max_output_tokens=30,
                                 temperature=0) as stream:
        assert stream.get_final_response().output_parsed == r.output_parsed


def test_agents_sdk_items_are_the_chat_s_messages(srv, client):
    """The items the Agents SDK sends: typed messages of input_text parts, an earlier output sent back as it
    came, a function_call_output whose output is a list of input_text parts (a tool's structured output)."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"unit": "c"}',
            "id": "fc_1", "status": "completed"}
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
             call, {"type": "function_call_output", "call_id": "call_1",
                    "output": [{"type": "input_text", "text": "sunny"}]}]
    as_text = [{"role": "user", "content": "weather?"}, call,
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    a, b = (client.responses.create(model="tiny", input=i, instructions="be brief", tools=[WEATHER],
                                    max_output_tokens=2, temperature=0) for i in (items, as_text))
    assert a.usage.input_tokens == b.usage.input_tokens and a.output_text == b.output_text


@pytest.mark.parametrize("body, status, param", [
    ({"n": 2}, 400, "n"),
    ({"input": []}, 400, "input"),
    ({"input": [], "instructions": "you help"}, 200, None),
    ({"stream_options": {"include_obfuscation": True}, "stream": False}, 200, None),
])
def test_fields_a_responses_body_has_or_has_not(srv, body, status, param):
    r = _post(srv, **body)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


# -- slots, clients that leave, failures ---------------------------------------------------------------------------
async def _open_stream(url: str, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps({"model": "tiny", **body}).encode()
    writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return reader, writer


# greedy: no end of text within it; two fit in the L1 pool at once (a second one waited for the first to end)
LONG = {"input": "go", "max_output_tokens": 900, "temperature": 0}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_aborts_its_engine_request_and_frees_its_slot(srv, stream):
    before = _idle(srv)["engine"]

    async def scenario():
        reader, writer = await _open_stream(srv.url, {**LONG, "stream": stream})
        if stream:
            seen = b""
            while b"response.output_text.delta" not in seen:  # a token arrived; then the client goes away
                seen += await reader.read(65536)
        else:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                while (await c.get("/hicache/status")).json()["engine"]["decode_tokens"] < before["decode_tokens"] + 4:
                    await asyncio.sleep(0.01)
        writer.close()
    asyncio.run(scenario())
    eng = _idle(srv)["engine"]
    assert eng["aborted"] - before["aborted"] == 1, eng
    assert eng["decode_tokens"] - before["decode_tokens"] < LONG["max_output_tokens"] - 1, eng


def test_a_full_server_s_429_and_refusals_take_no_slot_and_each_slot_is_freed_once(srv):
    _idle(srv)

    async def scenario():
        held = [await _open_stream(srv.url, {**LONG, "stream": True}) for _ in range(2)]
        for reader, _ in held:
            seen = b""
            while b"response.output_text.delta" not in seen:
                seen += await reader.read(65536)
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            full = await c.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 1})
            bad = await c.post("/v1/responses", json={"model": "tiny", "input": "hi", "n": 2})
            in_flight = (await c.get("/hicache/status")).json()["server"]["in_flight"]
        for _, writer in held:
            writer.close()
        return full, bad, in_flight
    full, bad, in_flight = asyncio.run(scenario())
    assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text
    assert full.json()["error"]["code"] == "too_many_requests"
    assert bad.status_code == 429 and in_flight == 2  # (refused before its body was read as a Response's)
    assert _idle(srv)["server"]["in_flight"] == 0
    for body in ({"n": 2}, {"previous_response_id": "resp_1"}, {"model": "other"}, {"max_output_tokens": 2040}):
        assert _post(srv, **body).status_code in (400, 404)
        assert _status(srv)["server"]["in_flight"] == 0  # (released before the error was answered)


def test_an_engine_failure_mid_stream_ends_it_with_error_and_response_failed(srv, client):
    """A request the engine fails (its cached prefix is corrupt: NaN K/V): a stream ends with an `error` event
    and `response.failed` (the SDK reads both), a whole response is the engine's 500; the slot is freed."""
    from test_sampling_hunt import _poison_l1_prefix

    body = {"input": "a prompt whose prefix is poisoned", "max_output_tokens": 8, "temperature": 0}
    ids = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": body["input"]}]},
                     timeout=30).json()["tokens"]

    def poison() -> None:
        assert _post(srv, **body).status_code == 200  # (its prefix is now in L1)
        _idle(srv)
        srv.call(_poison_l1_prefix, srv.engine, ids[:8])

    poison()
    events = _events(srv, body)
    final = check_events(events)
    error = next(e for e in events if e["type"] == "error")
    assert error["code"] == "engine_error" and "the engine failed this request" in error["message"], error
    assert final["status"] == "failed" and final["error"]["code"] == "server_error"
    poison()  # (the failure dropped the poisoned prefix)
    with pytest.raises(openai.InternalServerError) as info:
        client.responses.create(model="tiny", **body)
    assert info.value.body["code"] == "engine_error"
    assert _idle(srv)["server"]["in_flight"] == 0
    assert _post(srv).status_code == 200  # (the poisoned pages, shared by every chat's "<use", were dropped)


def test_parse_request_names_a_surrogate_without_a_server():
    with pytest.raises(APIError) as info:
        parse_request({"input": "hi", "metadata": {"k": "\ud800"}})
    assert info.value.param == "metadata.k"

"""What an OpenAI client gets, found unpinned by session 60's mutation check of scheduler/responses_items.py,
responses_output.py, api_guided.py and server.py: the Responses input items the SDK sends back, a Response's fields
and its stream's events (their framing, numbering, end and failure), structured outputs' fields and the field a 400
names, and the HTTP layer's status codes, headers and limits. A server through starlette's TestClient (the tiny
preset, a one-line chat template), the rest by direct calls on fakes."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from scheduler import server
from scheduler.api_guided import GuidedFieldError, GuidedFields
from scheduler.api_models import APIError
from scheduler.api_responses import ResponsesRequest
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.request import RequestError
from scheduler.responses_items import _INPUT_ITEM, FunctionCallItem, MessageItem, ReasoningItem
from scheduler.responses_output import OutputItems, ResponseOutput, _status, _usage, sse_block
from scheduler.server import ServerLimits, create_app

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
KEY = "sk-s60-api"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def client():
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    limits = ServerLimits(shutdown_grace_s=0.5, max_concurrent_requests=2, chat_template=TEMPLATE, api_key=KEY)
    app = create_app(engine, limits)

    @app.get("/s60-boom")
    async def boom():
        raise RuntimeError("kaboom")

    with TestClient(app, headers=AUTH, raise_server_exceptions=False) as c:
        c.hc = app.state.hc
        yield c


# -- responses_items ------------------------------------------------------------------------------------
@pytest.mark.parametrize("item", [
    {"role": "assistant", "content": [{"type": "output_text", "text": "hi", "annotations": []}]},
    {"role": "developer", "content": "be brief"},
    {"type": None, "role": "user", "content": "hi"},
    {"type": "message", "role": "assistant", "content": "hi", "phase": "final_answer", "status": "incomplete"},
    {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "42"}]},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thought"}]},
], ids=["output_text-part", "developer", "type-null", "final_answer-incomplete", "output-parts", "summary_text"])
def test_input_items_take_what_the_sdk_sends_back(item):
    """Each form is OpenAI's and the openai SDK sends it back from an earlier response (or a user writes it): an
    output_text part, a developer message, a message whose type is null, an assistant message's phase
    "final_answer" and status "incomplete", a function_call_output given as text parts, a reasoning summary_text."""
    _INPUT_ITEM.validate_python(item)


def test_a_function_calls_async_flag_is_taken_by_its_name_and_by_its_alias():
    """The SDK's model_dump() writes a call's `async` as "async_", its JSON as "async": both are accepted."""
    base = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    assert FunctionCallItem.model_validate({**base, "async_": True}).async_ is True
    assert FunctionCallItem.model_validate({**base, "async": False}).async_ is False


@pytest.mark.parametrize("item", [
    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]},
    {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": "u"}]},
], ids=["message", "function_call_output"])
def test_a_non_text_part_is_refused_by_name(item):
    """An image part is refused with a message naming its type and saying the server takes text, in a message's
    content and in a function_call_output's output alike (not pydantic's generic union error)."""
    with pytest.raises(ValidationError) as exc:
        _INPUT_ITEM.validate_python(item)
    assert "content parts of type 'input_image' are not supported" in str(exc.value)


def test_an_item_without_a_type_is_a_message():
    """An item without `type` (the API's easy input message) is a message."""
    assert isinstance(_INPUT_ITEM.validate_python({"role": "user", "content": "hi"}), MessageItem)


def test_a_reasoning_items_text_is_its_content_else_its_summary_a_line_each():
    """A reasoning item sent back reads as its content's texts (its summary only without content), one line each."""
    item = ReasoningItem.model_validate({"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}],
                                         "content": [{"type": "reasoning_text", "text": "a"},
                                                     {"type": "reasoning_text", "text": "b"}]})
    assert item.text() == "a\nb"


def test_a_reasoning_item_with_encrypted_content_is_refused():
    """This server sends no encrypted reasoning, so it takes none back (it could not read it)."""
    with pytest.raises(ValidationError):
        _INPUT_ITEM.validate_python({"type": "reasoning", "summary": [], "encrypted_content": "gAAA"})


# -- responses_output: items -------------------------------------------------------------------------------
def test_reasoning_then_text_then_a_call_are_three_items_each_done_at_its_index():
    """Reasoning, then content, then a call: three items (the message finished before the call starts), each
    item's done events at its own output_index, the text part with its (empty) annotations."""
    items = OutputItems()
    events = items.feed({"reasoning_content": "think"}) + items.feed({"content": "hi"})
    events += items.feed({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{}"}}]})
    events += items.close("completed")
    assert [i["type"] for i in items.items] == ["reasoning", "message", "function_call"]
    assert items.items[1]["content"] == [{"type": "output_text", "text": "hi", "annotations": []}]
    done = [(e["type"], e["output_index"]) for e in events if e["type"].endswith(".done")]
    assert done == [("response.reasoning_text.done", 0), ("response.content_part.done", 0),
                    ("response.output_item.done", 0), ("response.output_text.done", 1),
                    ("response.content_part.done", 1), ("response.output_item.done", 1),
                    ("response.function_call_arguments.done", 2), ("response.output_item.done", 2)]


def test_only_a_length_finish_is_incomplete():
    """finish_reason "length" is an incomplete response; "stop" and "tool_calls" completed ones."""
    assert (_status("length"), _status("stop"), _status("tool_calls")) == ("incomplete", "completed", "completed")


def test_the_usage_carries_cached_and_reasoning_tokens():
    """Responses' usage keeps the chat's cached prompt tokens and its reasoning tokens."""
    chat = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14, "prompt_tokens_details":
            {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 3}}
    usage = _usage(chat)
    assert usage["input_tokens_details"]["cached_tokens"] == 4
    assert usage["output_tokens_details"]["reasoning_tokens"] == 3


# -- responses_output: a stream on a fake chat ---------------------------------------------------------------
class _FakeChoices:
    """Choices' surface ResponseOutput reads: its chunks as the chat's stream lines."""

    def __init__(self, chunks):
        self.rid, self.created, self.model, self.chunks = "chatcmpl-s60", 1, "tiny", chunks
        self.gens = [SimpleNamespace(req=SimpleNamespace(params=SimpleNamespace(temperature=1.0, top_p=1.0)))]

    async def sse(self):
        for chunk in self.chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    def usage_body(self):
        return {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3, "prompt_tokens_details":
                {"cached_tokens": 0}}


def _events(chunks, keep=None, **body):
    out = ResponseOutput(_FakeChoices(chunks), ResponsesRequest.model_validate({"input": "hi", **body}), keep)

    async def run():
        return [e async for e in out.events()]
    return asyncio.run(run())


def test_a_failed_choice_ends_the_stream_with_an_error_event_and_response_failed():
    """A choice that fails mid-stream: its open message finished "incomplete", an `error` event with the code,
    message and param, then `response.failed` whose Response is status "failed"."""
    text = {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}
    error = {"error": {"code": "engine_failed", "message": "boom", "param": None, "type": "server_error"}}
    events = _events([text, error])
    assert events[-2] == {"type": "error", "code": "engine_failed", "message": "boom", "param": None,
                          "sequence_number": len(events) - 2}
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"


def test_a_background_stream_is_queued_then_in_progress_and_kept_by_its_run_alone():
    """A background response's stream says created (queued), `response.queued`, then in_progress, numbered
    from 0; its Response is kept by its run (responses_background.py), not by the stream's last event."""
    kept = []
    stop = {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}]}
    events = _events([stop], kept.append, background=True)
    assert [e["type"] for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed" and kept == []
    _events([stop], kept.append)  # (not in the background: kept as it finishes)
    assert len(kept) == 1


def test_a_server_sent_event_names_its_type():
    """Each Responses event is framed as `event: <type>` then `data: <json>` (the SDK's stream reads the type)."""
    assert sse_block({"type": "response.created"}) == 'event: response.created\ndata: {"type": "response.created"}\n\n'


# -- responses through the server -------------------------------------------------------------------------
def test_a_whole_response_cut_by_max_output_tokens(client):
    """A response cut by max_output_tokens: status "incomplete", incomplete_details.reason "max_output_tokens",
    its message "incomplete"; the request's defaults echoed as the SDK's Response wants them (parallel_tool_calls
    true, tool_choice "auto"); "store": false when it was asked not to be kept."""
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "store": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][-1]["status"] == "incomplete"
    assert body["parallel_tool_calls"] is True and body["tool_choice"] == "auto" and body["store"] is False


def test_a_streamed_response_is_numbered_from_0_and_ends_with_its_status_event(client):
    """A stream's events are `event:`-framed, numbered 0, 1, ... and end with `response.incomplete` (the
    stream's end marker for an answer cut by max_output_tokens), sent with no-cache headers."""
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "stream": True})
    assert r.status_code == 200 and r.headers["cache-control"] == "no-cache"
    blocks = [b for b in r.text.split("\n\n") if b]
    events = [json.loads(b.split("\ndata: ", 1)[1]) for b in blocks]
    assert all(b.startswith(f"event: {e['type']}\n") for b, e in zip(blocks, events))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"


# -- api_guided ---------------------------------------------------------------------------------------------
def _guided(**fields):
    return GuidedFields.model_validate(fields).guided()


def test_two_structured_output_fields_name_the_second():
    """Two fields asking at once: the 400 names the second (the first is where the client meant it)."""
    with pytest.raises(GuidedFieldError) as exc:
        _guided(guided_regex="a+", guided_grammar="start: \"a\"")
    assert exc.value.param == "guided_grammar"


def test_response_format_json_schema_without_its_schema_object_is_a_400():
    """{"type": "json_schema"} without `json_schema` is a 400 naming response_format (not a 500)."""
    with pytest.raises(GuidedFieldError) as exc:
        _guided(response_format={"type": "json_schema"})
    assert exc.value.param == "response_format"


def test_response_format_text_and_json_object_and_a_schema_without_schema():
    """{"type": "text"} asks for nothing; json_object, and a json_schema format without `schema`, ask for any JSON
    object; a named schema asks for it."""
    assert _guided(response_format={"type": "text"}) == (None, None)
    assert _guided(response_format={"type": "json_object"})[1] == GuidedSpec.json_object()
    assert _guided(response_format={"type": "json_schema", "json_schema": {"name": "n"}})[1] == GuidedSpec.json_object()
    field, spec = _guided(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type":
                                                                                                      "integer"}}})
    assert field == "response_format" and json.loads(spec.value) == {"type": "integer"}


@pytest.mark.parametrize("fmt", [{"type": "json_schema", "json_schema": {"schema": {}}},
                                 {"type": "json_object", "extra": 1}], ids=["no-name", "unknown-key"])
def test_response_format_is_held_to_openais_fields(fmt):
    """A json_schema format without its required `name`, or an unknown key, is refused."""
    with pytest.raises(ValidationError):
        GuidedFields.model_validate({"response_format": fmt})


def test_structured_outputs_takes_exactly_one_key():
    """An empty `structured_outputs` is a 400 naming it (not a 500); `json_object: true` alone asks for it."""
    with pytest.raises(GuidedFieldError) as exc:
        _guided(structured_outputs={})
    assert exc.value.param == "structured_outputs"
    assert _guided(structured_outputs={"json_object": True}) == ("structured_outputs", _guided(
        response_format={"type": "json_object"})[1])


def test_guided_values_reach_the_spec_as_given():
    """A schema given as JSON text is passed as it is (not encoded twice); choices are a JSON list; a grammar
    is asked for by guided_grammar."""
    assert _guided(guided_json='{"type": "integer"}')[1].value == '{"type": "integer"}'
    assert json.loads(_guided(guided_choice=["a", "b"])[1].value) == ["a", "b"]
    assert _guided(guided_grammar='start: "a"')[0] == "guided_grammar"


# -- server -------------------------------------------------------------------------------------------------
def _fake_state(limit: int, draining: bool = False):
    gauge = SimpleNamespace(inc=lambda n=1: None, dec=lambda n=1: None)
    return SimpleNamespace(in_flight=0, limits=SimpleNamespace(max_concurrent_requests=limit),
                           metrics=SimpleNamespace(in_flight=gauge), draining=draining,
                           engine=SimpleNamespace(accepting=not draining), check_admitting=lambda: None)


def test_the_concurrency_limit_admits_up_to_it_then_429_with_retry_after():
    """--max-concurrent-requests 1 admits one request; the next is a 429 with Retry-After."""
    st = _fake_state(1)
    server._Slot(st)
    with pytest.raises(APIError) as exc:
        server._Slot(st)
    assert exc.value.status == 429 and exc.value.headers == {"Retry-After": "1"}


def test_an_engine_refusal_while_shutting_down_is_a_503_and_a_batchs_names_its_prompt():
    """The engine refusing a prompt once the server drains is a 503; a batch's refusal names prompt.<i>."""
    api_req = SimpleNamespace(max_completion_tokens=None)
    err = server._refused(_fake_state(4, draining=True), RequestError("not accepting"), 0, 1, api_req)
    assert err.status == 503
    err = server._refused(_fake_state(4), RequestError("too long"), 2, 3, api_req)
    assert err.status == 400 and err.param == "prompt.2"


def test_a_batch_exactly_at_the_concurrency_limit_is_served(client):
    """n equal to --max-concurrent-requests is served; n=3 over 2 is the 400 naming `n`, 3 prompts naming
    `prompt`."""
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 2}).status_code == 200
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_completion_gives_its_slots_back(client):
    """After a whole (not streamed) completion, nothing is counted in flight."""
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    assert client.hc.in_flight == 0


def test_a_wrong_method_is_a_405_with_allow_and_a_bug_is_a_500(client):
    """A wrong method: 405 with its Allow header (RFC 9110); an exception in a route: a 500 JSON error."""
    r = client.put("/v1/models")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
    r = client.get("/s60-boom")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"


def test_a_bad_query_parameter_is_a_400_naming_it(client):
    """FastAPI's query validation (input_items' limit) is a 400 naming the parameter, not a 422."""
    r = client.get("/v1/responses/resp_x/input_items", params={"limit": "abc"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_models_routes_take_a_trailing_slash(client):
    """/v1/models/tiny/ is the model; /v1/models// the list."""
    assert client.get("/v1/models/tiny/").json()["id"] == "tiny"
    assert client.get("/v1/models//").json()["object"] == "list"


def test_status_and_metrics_headers_and_never_the_key(client):
    """/hicache/status says whether a key is set, never the key, and the prompt limit in force (the engine's where
    the server sets none, not 0); /metrics is Prometheus' text format 0.0.4."""
    r = client.get("/hicache/status")
    assert r.json()["server"]["limits"]["api_key"] is True and KEY not in r.text
    assert r.json()["server"]["limits"]["max_prompt_tokens"] == client.hc.engine.max_prompt_tokens > 0
    assert client.get("/metrics").headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_a_draining_server_fails_health_and_refuses_with_503(client):
    """Once shutting down, /health and a new completion are 503s (a load balancer stops sending traffic)."""
    client.hc.draining = True
    try:
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    finally:
        client.hc.draining = False


@pytest.mark.parametrize("field, value", [("guided_grammar", "start: ("), ("guided_regex", "(")])
def test_a_grammar_the_engine_cannot_compile_is_a_400_naming_its_field(client, field, value):
    """The engine's refusal of a grammar names the request's field that asked for it, not the engine's "guided"."""
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_client_gone_mid_body_is_a_499_counted_aborted_and_holds_no_slot(client):
    """A client that leaves while its body is read is answered 499 (client closed request), counted as aborted,
    not as a rejected 400, and holds none of --max-concurrent-requests (session 61: server.py's S20 survived)."""
    def aborted() -> float:
        return client.hc.metrics.requests.labels("aborted")._value.get()

    before, sent = aborted(), []
    messages = [{"type": "http.request", "body": b'{"prompt": "h', "more_body": True}, {"type": "http.disconnect"}]

    async def call():
        async def receive():
            return messages.pop(0) if len(messages) > 1 else messages[0]

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "client": ("test", 1), "server": ("test", 80),
                 "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())]}
        await client.app(scope, receive, send)

    client.portal.call(call)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499, sent
    assert aborted() == before + 1 and client.hc.in_flight == 0

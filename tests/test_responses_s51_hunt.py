"""Regressions from session 51's hunt of the HTTP surface: JSON's non-numbers in a body, a Response id its GET route
cannot read, OpenAI's bounds on `metadata`, and the end of a background response's stream when it is cancelled."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from openai.types.responses import Response

from test_responses_background import _server, _streamed
from test_responses_hunt import LONG, _idle

TOOL = ('{"type": "function", "name": "f", "parameters": {"type": "object", "properties": '
        '{"x": {"type": "number", "maximum": CONSTANT}}}}')


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with _server(tmp_path_factory) as s:
        yield s


def _raw(srv, route: str, body: str) -> httpx.Response:
    return httpx.post(srv.url + route, content=body, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e400", "-2.5E+999"])
@pytest.mark.parametrize("route, body, param", [
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "request_id": "nan-r", "tools": [%s]}' % TOOL,
     "tools.0.parameters.properties.x.maximum"),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "stream": true, "tools": [%s]}' % TOOL,
     "tools.0.parameters.properties.x.maximum"),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "text", "schema": '
                      '{"a": [1.5, CONSTANT]}}}}', "text.format.schema.a.1"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                             '"temperature": CONSTANT}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "top_p": CONSTANT}', "top_p"),
], ids=["tool", "tool-stream", "schema", "chat", "completion"])
def test_a_body_with_a_number_json_cannot_carry_is_a_400_naming_it_and_nothing_is_generated_or_kept(
        srv, route, body, param, constant):
    """Python's json reads NaN and Infinity, and 1e400 as inf; JSON carries none of them: a field taking any JSON (a
    tool's parameters, a schema) carried one into a Response no encoder would send, a 500 after the answer was
    generated, the response kept and its GET a 500 from then on (a stream sent the bare token in its events)."""
    before = _idle(srv)
    r = _raw(srv, route, body.replace("CONSTANT", constant))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "finite" in error["message"] and constant in error["message"], error
    assert httpx.get(srv.url + "/v1/responses/nan-r", timeout=30).status_code == 404
    after = _idle(srv)
    assert after["engine"]["finished"] == before["engine"]["finished"]
    srv.call(srv.engine.check_integrity)


def test_finite_numbers_and_their_text_are_served(srv):
    """The check reads numbers, not text: "NaN" in a prompt, 1e308 in a schema are served."""
    body = ('{"input": "NaN and Infinity", "max_output_tokens": 2, "text": {"format": {"type": "text", "schema": '
            '{"a": 1e308, "b": -0.0, "c": 12345678901234567890123}}}}')
    r = _raw(srv, "/v1/responses", body)
    assert r.status_code == 200, r.text


def test_a_request_id_ending_in_input_items_is_a_400_naming_it(srv):
    """GET /v1/responses/{id}/input_items reads a response's input items: a Response of the id "r/input_items" was
    kept, and its GET gave response r's input items, or a 404 naming "r". Other slashes stay served."""
    r = httpx.post(srv.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                     "request_id": "r/input_items"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
    assert "input_items" in r.json()["error"]["message"]
    ok = httpx.post(srv.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                      "request_id": "team/input_items2"}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert httpx.get(srv.url + "/v1/responses/team/input_items2", timeout=30).json()["id"] == "team/input_items2"


@pytest.mark.parametrize("metadata, why", [
    ({f"k{i}": "v" for i in range(17)}, "17 pairs"),
    ({"k" * 65: "v"}, "a 65-character key"),
    ({"k": "v" * 513}, "a 513-character value"),
])
def test_metadata_past_openai_s_bounds_is_a_400_naming_it(srv, metadata, why):
    """OpenAI's Metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512; each was echoed and
    kept past them."""
    r = httpx.post(srv.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "metadata": metadata},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("metadata"), (why, r.text)


@pytest.mark.parametrize("route, body", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                         ("/v1/completions", {"prompt": "hi"})])
def test_a_chat_s_or_completion_s_metadata_past_the_bounds_is_a_400_too(srv, route, body):
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        r = httpx.post(srv.url + route, json={**body, "max_tokens": 2, "metadata": metadata}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("metadata"), r.text
    ok = httpx.post(srv.url + route, json={**body, "max_tokens": 2, "metadata": {"k" * 64: "v" * 512}}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_metadata_at_openai_s_bounds_is_served_and_echoed(srv):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    r = httpx.post(srv.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "metadata": metadata},
                   timeout=60)
    assert r.status_code == 200 and r.json()["metadata"] == metadata, r.text


def _check_cut_short(events: list[dict], response_id: str) -> dict:
    """A stream that ends as a cancelled response's: numbered without gaps, each item it added done, the last
    event response.cancelled with the Response; returns that Response."""
    assert [e["sequence_number"] for e in events] == list(range(events[0]["sequence_number"],
                                                                events[0]["sequence_number"] + len(events)))
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert added and added == [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    last = events[-1]
    assert last["type"] == "response.cancelled" and last["response"]["status"] == "cancelled"
    response = Response.model_validate(last["response"])  # (the openai SDK's type)
    assert response.id == response_id and [item.id for item in response.output] == added
    assert response.output[-1].status == "incomplete" and response.usage.output_tokens >= 1
    return last["response"]


def streamed_until(srv, body: dict, kind: str, count: int) -> tuple[threading.Thread, list[dict], dict]:
    """A background response's POST streamed by a thread until `count` events of `kind` came: (the thread, its events
    so far, {"id": the response's id})."""
    events, ids = [], {}

    def post_stream():
        with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "background": True, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "response.created":
                        ids["id"] = events[-1]["response"]["id"]

    reader = threading.Thread(target=post_stream)
    reader.start()
    deadline = time.monotonic() + 60
    while sum(e["type"] == kind for e in events) < count:
        assert time.monotonic() < deadline and reader.is_alive()
        time.sleep(0.01)
    return reader, events, ids


def test_a_cancelled_background_stream_ends_with_its_items_done_and_response_cancelled(srv):
    """A background response streamed (its POST, and GET ?stream=true) and cancelled midway: the stream stopped on a
    text delta, its message never done, and GET's Response left the message out. Now its message is finished
    "incomplete", the last event is response.cancelled with the Response GET then reads, holding what was streamed."""
    reader, events, ids = streamed_until(srv, {**LONG, "model": "tiny"}, "response.output_text.delta", 1)
    cancelled = httpx.post(f"{srv.url}/v1/responses/{ids['id']}/cancel", timeout=60).json()
    reader.join(60)
    assert not reader.is_alive()
    final = _check_cut_short(events, ids["id"])
    assert cancelled == final == httpx.get(f"{srv.url}/v1/responses/{ids['id']}", timeout=30).json()
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final["output"][-1]["content"][0]["text"] == text
    replay = _streamed(f"{srv.url}/v1/responses/{ids['id']}", params={"stream": "true", "starting_after": "0"})
    assert replay == events[1:]
    _idle(srv)
    srv.call(srv.engine.check_integrity)


# -- what the openai SDK sends back, and vLLM's fields -------------------------------------------------------------
def test_output_items_sent_back_as_the_sdk_dumps_them_with_openai_s_newer_fields_are_served(srv):
    """An output message's model_dump() carries `phase` (null), which the SDK's types ask clients to send back (Codex
    does, "commentary" / "final_answer"), and a call or its output OpenAI's `caller`, `namespace`, `async`: each was a
    400 "Extra inputs are not permitted", so a conversation kept as JSON could not go on."""
    first = _raw(srv, "/v1/responses", json.dumps({"input": "hi", "max_output_tokens": 3})).json()
    # (a message's dump carries `phase`; a reasoning item's has none: the sampled answer may open with one, as it
    # did under random order, seed 6920)
    output = [{**item, "phase": None} if item["type"] == "message" else item for item in first["output"]]
    items = [{"role": "user", "content": "hi"}, *output,
             {"role": "assistant", "content": "and so", "phase": "final_answer"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "caller": None,
              "namespace": "tools", "async": False},
             {"type": "function_call_output", "call_id": "c1", "output": "done", "caller": None, "namespace": "tools"},
             {"role": "user", "content": "next"}]
    r = _raw(srv, "/v1/responses", json.dumps({"input": items, "max_output_tokens": 2}))
    assert r.status_code == 200, r.text
    bad = _raw(srv, "/v1/responses", json.dumps({"input": [{"role": "assistant", "content": "x", "phase": "other"}]}))
    assert bad.status_code == 400 and "phase" in bad.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [("top_k", 5), ("logit_bias", {"65": 5.0}), ("skip_special_tokens", False),
                                          ("priority", 0)])
def test_vllm_s_responses_fields_are_passed_to_the_chat_that_serves_it(srv, field, value):
    """vLLM's ResponsesRequest takes them, and the chat this endpoint is served as does: each was "unknown field"."""
    r = _raw(srv, "/v1/responses", json.dumps({"input": "hi", "max_output_tokens": 2, field: value}))
    assert r.status_code == 200, r.text
    bad = {"top_k": "x", "logit_bias": {"65": "x"}, "skip_special_tokens": 1, "priority": 1.5}[field]
    r = _raw(srv, "/v1/responses", json.dumps({"input": "hi", "max_output_tokens": 2, field: bad}))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


def test_a_logit_bias_through_responses_reaches_the_answer(srv):
    """(Passed on, not only accepted: a bias of 100 on one token makes every greedy token that one.)"""
    [q] = httpx.post(srv.url + "/tokenize", json={"prompt": "Q", "add_special_tokens": False}, timeout=30).json()["tokens"]
    r = _raw(srv, "/v1/responses", json.dumps({"input": "hi", "max_output_tokens": 3, "temperature": 0,
                                               "logit_bias": {str(q): 100}})).json()
    text = r["output"][0]["content"][0]["text"]
    assert set(text) == {"Q"}, r


@pytest.mark.parametrize("route, body", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                         ("/v1/completions", {"prompt": "hi"})])
def test_vllm_s_return_token_ids_and_spaces_between_special_tokens(srv, route, body):
    """vLLM's CompletionRequest / ChatCompletionRequest fields (RL rollout clients send return_token_ids): each was an
    "unknown field" 400. return_token_ids puts the prompt's token ids where prompt_logprobs go (a chat's at the top
    level, a completion's on each choice; a stream's on each choice's first chunk); choices carry token_ids anyway."""
    base = {**body, "max_tokens": 2, "temperature": 0}
    plain = httpx.post(srv.url + route, json=base, timeout=60).json()
    r = httpx.post(srv.url + route, json={**base, "return_token_ids": True, "spaces_between_special_tokens": False},
                   timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    where = [got] if "messages" in body else got["choices"]
    assert all(w["prompt_token_ids"] and all(isinstance(t, int) for t in w["prompt_token_ids"]) for w in where)
    assert len(where[0]["prompt_token_ids"]) == got["usage"]["prompt_tokens"]
    assert got["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"] and "prompt_token_ids" not in plain
    with httpx.stream("POST", srv.url + route, json={**base, "return_token_ids": True, "stream": True},
                      timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    firsts = [c for c in chunks if "prompt_token_ids" in c or "prompt_token_ids" in c["choices"][0]]
    assert len(firsts) == 1 and firsts[0] is chunks[0]


def test_a_chat_message_the_sdk_s_parse_returned_is_taken_back(srv):
    """`client.chat.completions.parse(response_format=Model)` returns a message carrying `parsed` (the client's own
    parse of its content), and the documented follow-up sends it back: a 400 "'parsed' is not supported (only null)".
    It changes nothing, whatever its value; the SDK's null-valued fields stay taken at null only."""
    parsed = {"role": "assistant", "content": "{\"a\": 1}", "parsed": {"a": 1}, "refusal": None}
    body = {"messages": [{"role": "user", "content": "hi"}, parsed, {"role": "user", "content": "more"}],
            "max_tokens": 2}
    assert httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    body["messages"][1] = {**parsed, "refusal": "no"}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "refusal" in r.json()["error"]["message"]

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


def test_a_cancelled_background_stream_ends_with_its_items_done_and_response_cancelled(srv):
    """A background response streamed (its POST, and GET ?stream=true) and cancelled midway: the stream stopped on a
    text delta, its message never done, and GET's Response left the message out. Now its message is finished
    "incomplete", the last event is response.cancelled with the Response GET then reads, holding what was streamed."""
    events, ids = [], {}

    def post_stream():
        body = {**LONG, "model": "tiny", "background": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "response.created":
                        ids["id"] = events[-1]["response"]["id"]

    reader = threading.Thread(target=post_stream)
    reader.start()
    deadline = time.monotonic() + 60
    while not any(e["type"] == "response.output_text.delta" for e in events):
        assert time.monotonic() < deadline and reader.is_alive()
        time.sleep(0.01)
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

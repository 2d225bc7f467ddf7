"""A follow-up by previous_response_id after an answer of text, a call and text after it (the hermes parser's "auto"):
its prompt is the one the chat completion's own answer makes, whether the answer was served whole or streamed (a
stream renders the text after the call as a second message item; scheduler/api_responses.items_messages). The
prefix cache serves a follow-up only where its prompt starts with the earlier turn's prompt and answer tokens.

The answer is forced over HTTP as tests/test_responses_logprobs_gaps.py forces it (a `guided_regex` on the chat
body that serves a Responses request)."""
from __future__ import annotations

import json

import httpx

from scheduler import api_responses
from scheduler.api_responses import items_messages, parse_request
import test_responses_api
from test_responses_api import WEATHER
from test_tool_calls_hunt import _regex

srv = test_responses_api.srv  # (its server: hermes, qwen3)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'
ANSWER = "Let me look." + CALL + "Done."


def _forced(monkeypatch, answer: str) -> None:
    chat_body = api_responses.chat_body
    monkeypatch.setattr(api_responses, "chat_body", lambda req, history=(): {
        **chat_body(req, history), "guided_regex": _regex(answer)})


def _post(srv, **body) -> dict:
    body = {"model": "tiny", "max_output_tokens": 120, "temperature": 0, "tools": [WEATHER], **body}
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(srv, **body) -> dict:
    body = {"model": "tiny", "max_output_tokens": 120, "temperature": 0, "tools": [WEATHER], **body, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    return events[-1]["response"]


def test_a_follow_up_after_text_after_a_call_has_the_chat_s_prompt_whole_or_streamed(srv, monkeypatch):
    """(regression: the follow-up of the streamed answer had a "\\n" more in its prompt than the whole one's: the
    stream's two message items were two text parts of the assistant turn, which a chat's content joins by "\\n")"""
    _forced(monkeypatch, ANSWER)
    whole, streamed = _post(srv, input="weather?"), _streamed(srv, input="weather?")
    assert [i["type"] for i in whole["output"]] == ["message", "function_call"]
    assert [i["type"] for i in streamed["output"]] == ["message", "function_call", "message"]
    chat = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 120, "temperature": 0,
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        "guided_regex": _regex(ANSWER)}).json()["choices"][0]["message"]
    [call] = chat["tool_calls"]
    result = {"type": "function_call_output", "call_id": "call_x", "output": "sunny"}
    follow = {kind: _post(srv, input=[result], previous_response_id=r["id"], max_output_tokens=1, store=False)
              for kind, r in (("whole", whole), ("streamed", streamed))}
    # the conversation as the chat answered it: its content and its call, then the result
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": chat["content"], "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_x", "content": "sunny"}]
    own = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": 1, "tools": [{"type": "function", "function": {
            k: v for k, v in WEATHER.items() if k != "type"}}]}).json()
    assert follow["whole"]["usage"]["input_tokens"] == own["usage"]["prompt_tokens"]
    assert follow["streamed"]["usage"]["input_tokens"] == own["usage"]["prompt_tokens"]


def test_text_after_a_call_continues_the_turn_s_text():
    """items_messages: a message item after a call in one assistant turn continues its text (one chat answer's
    content around its calls); two message items with no call between stay two parts (joined by "\\n")."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}

    def turn(*items) -> dict:
        return items_messages(parse_request({"input": list(items)}).input)[0]

    def text(t: str) -> dict:
        return {"role": "assistant", "content": [{"type": "output_text", "text": t}]}

    assert turn(text("a"), call, text("b"))["content"] == [{"type": "text", "text": "ab"}]
    assert turn(call, text("b"))["content"] == [{"type": "text", "text": "b"}]
    assert turn(text("a"), text("b"))["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]

"""Session 80's hunt over tool calls and reasoning as vLLM parses them: regressions."""
from __future__ import annotations

import json

import httpx
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
HI = [{"role": "user", "content": "weather?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
# the answer held to one hermes call whose markers are the tokenizer's special tokens 256 and 257 (llguidance's
# Lark names a token by its id)
CALL = 'start: <[256]> "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}" <[257]>'


@pytest.fixture(scope="module")
def special_markers(tmp_path_factory):
    """A hermes-parsing server whose tokenizer marks <tool_call> and </tool_call> special, as some fine-tunes'
    tokenizers do."""
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), special=("<tool_call>", "</tool_call>"),
                                config={"chat_template": TEMPLATE})
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=2048))
    limits = ServerLimits(shutdown_grace_s=1.0, tool_call_parser="hermes")
    with ServerThread(create_app(engine, limits, tokenizer=HFTokenizer(str(path)))) as s:
        yield s


def _body(**more) -> dict:
    return {"messages": HI, "tools": TOOLS, "guided_grammar": CALL, "max_tokens": 60, "temperature": 0, **more}


def test_calls_whose_markers_are_special_tokens_are_read_whole_and_streamed(special_markers):
    """vLLM's hermes parser decodes the answer of a chat with tools (tool_choice not "none") with its special
    tokens kept (`adjust_request`): a default decode left the markers out, so the parser never saw a call (regression:
    the call's JSON came back as the content, finish_reason "stop")."""
    r = httpx.post(special_markers.url + "/v1/chat/completions", json=_body(), timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    content, calls, finish = "", [], None
    with httpx.stream("POST", special_markers.url + "/v1/chat/completions", json=_body(stream=True), timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                delta_choice = json.loads(line[6:])["choices"][0]
                content += delta_choice["delta"].get("content") or ""
                calls += delta_choice["delta"].get("tool_calls") or []
                finish = delta_choice["finish_reason"] or finish
    assert (content, finish) == ("", "tool_calls")
    assert [c["function"] for c in calls] == [call["function"]]


def test_a_tool_choice_of_none_keeps_the_requests_decode(special_markers):
    """tool_choice "none": no call is read, and the text is decoded as the request asks (vLLM's: only where calls
    may be read are the special tokens kept)."""
    r = httpx.post(special_markers.url + "/v1/chat/completions", json=_body(tool_choice="none"), timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert "tool_calls" not in message

"""Regressions from session 52's hunt of streamed responses, read by the openai SDK as a client reads them:
a chat choice's first chunk is its role alone (vLLM's; the SDK's stream helper counted the first token's logprobs
twice for every choice after the first), the calls a "required" tool_choice sends at its end come in a chunk
before the finish chunk (the SDK never fired arguments.done for them), and stream_options' include_obfuscation
and a null include_usage are taken (both were 400s)."""
from __future__ import annotations

import pytest

from server_fixtures import byte_level_server, sse, tiny_config

MESSAGES = [{"role": "user", "content": "q"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config()) as s:
        yield s


def test_each_chat_choice_starts_with_its_role_alone(srv):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "n": 3, "temperature": 0.8, "seed": 5,
            "logprobs": True, "top_logprobs": 1, "return_token_ids": True}
    chunks = sse(srv, "/v1/chat/completions", body)
    for index in range(3):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        role = mine[0]["choices"][0]
        assert role["delta"] == {"role": "assistant", "content": ""} and role["logprobs"] is None
        assert role["token_ids"] == [] and role["finish_reason"] is None
        assert "prompt_token_ids" in mine[0]  # (vLLM's return_token_ids: on the first chunk)
        assert all("role" not in c["choices"][0]["delta"] for c in mine[1:])
        assert sum(len(c["choices"][0]["token_ids"]) for c in mine) == 4


def test_every_choices_role_chunk_comes_before_any_content(srv):
    """vLLM's serving_chat sends the n role chunks on its first iteration, ahead of every choice's tokens."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "n": 4, "temperature": 0.8, "seed": 7}
    chunks = [c for c in sse(srv, "/v1/chat/completions", body) if c["choices"]]
    assert [c["choices"][0]["index"] for c in chunks[:4]] == [0, 1, 2, 3]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in chunks[:4])
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[4:])


def test_the_sdks_stream_helper_counts_each_token_once(srv, client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=6, n=3, temperature=0.8, seed=5, logprobs=True,
              top_logprobs=1)
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        snapshot = stream.current_completion_snapshot
    whole = client.chat.completions.create(**kw)
    for streamed, choice in zip(snapshot.choices, whole.choices):
        assert len(streamed.logprobs.content) == len(choice.logprobs.content) == 6
        assert streamed.message.content == choice.message.content


def test_a_required_tool_choices_calls_come_before_the_finish_chunk(srv, client):
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=100, temperature=0)
    with client.chat.completions.stream(**kw) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and calls
    assert [e.arguments for e in done] == [c.function.arguments for c in calls]
    raw = sse(srv, "/v1/chat/completions", kw)
    finish = [c["choices"][0] for c in raw if c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and "tool_calls" not in finish[0]["delta"]


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", {"messages": MESSAGES}),
                                        ("/v1/completions", {"prompt": "hi"})])
@pytest.mark.parametrize("options, usage_chunk", [({"include_obfuscation": False}, False),
                                                  ({"include_obfuscation": True, "include_usage": True}, True),
                                                  ({"include_usage": None}, False)])
def test_stream_options_the_sdk_types_are_taken(srv, path, base, options, usage_chunk):
    chunks = sse(srv, path, {"model": "tiny", **base, "max_tokens": 2, "stream_options": options})
    assert (chunks[-1]["choices"] == []) is usage_chunk

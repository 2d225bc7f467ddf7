"""Regressions from session 51's hunt of chat tool calls and reasoning, as vLLM serves them: a call sent back with no
arguments, an answer that only thought, and vLLM's include_reasoning."""
from __future__ import annotations

import pytest

from scheduler.api_tools import MessageToolCall
from test_reasoning import END, START, _chat, _streamed, _thinking_then_answering, servers  # noqa: F401


@pytest.mark.parametrize("arguments, want", [("", {}), ("  ", {}), ("null", {}), ('{"a": 1}', {"a": 1}),
                                             ("[1]", "[1]"), ("not json", "not json")])
def test_a_call_sent_back_with_no_arguments_renders_an_empty_object(arguments, want):
    """vLLM's _postprocess_messages: arguments None or "" are {}, "null" too; a template wrote `"arguments": }`
    (invalid JSON in the prompt) for "", and null for "null". Other text stays as it came."""
    call = MessageToolCall.model_validate({"id": "c1", "function": {"name": "f", "arguments": arguments}})
    assert call.as_template_dict()["function"]["arguments"] == want


def test_an_answer_that_only_thought_has_null_content(servers):
    """vLLM's qwen3 parser returns content None for a thought cut off by max_tokens (and for one followed by nothing);
    the message said "" (a stream sends no content either way)."""
    parsed, _ = servers
    kw = {"logit_bias": {str(START): -100, str(END): -100}, "chat_template_kwargs": {"thinking": True}}
    message = _chat(parsed, **kw)["message"]
    assert message["reasoning_content"] and message["content"] is None, message
    assert _streamed(parsed, **kw) == (message["reasoning_content"], "")


def test_include_reasoning_false_leaves_the_thinking_out(servers):
    """vLLM's ChatCompletionRequest.include_reasoning (default true): false was an "unknown field" 400. The answer is
    the same, without its thinking (reasoning_content null, none streamed); usage still counts the reasoning tokens."""
    parsed, _ = servers
    kw = _thinking_then_answering(parsed)
    shown = _chat(parsed, **kw)
    hidden = _chat(parsed, include_reasoning=False, **kw)
    assert shown["message"]["reasoning_content"] and hidden["message"]["reasoning_content"] is None
    assert hidden["message"]["content"] == shown["message"]["content"]
    assert hidden["token_ids"] == shown["token_ids"]
    assert _streamed(parsed, include_reasoning=False, **kw) == ("", shown["message"]["content"])

"""Regressions from session 51's hunt of chat tool calls and reasoning, as vLLM serves them: a call sent back with no
arguments, an answer that only thought, and vLLM's include_reasoning."""
from __future__ import annotations

import pytest

from scheduler.api_tools import MessageToolCall
from test_reasoning import END, START, _chat, _streamed, _thinking_then_answering, servers  # noqa: F401


@pytest.mark.parametrize("arguments, want", [("", {}), ("  ", {}), ("null", {}), ('{"a": 1}', {"a": 1}),
                                             ("[1, 2]", [1, 2]), ("not json", "not json")])
def test_a_call_sent_back_with_no_arguments_renders_an_empty_object(arguments, want):
    """vLLM's _postprocess_messages: arguments None or "" are {}, "null" too, JSON parsed whatever it is; a
    template wrote `"arguments": }` (invalid JSON in the prompt) for "", null for "null", a list's text quoted.
    Text that is no JSON stays as it came."""
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


# -- a checkpoint's chat templates, as transformers reads them ------------------------------------------------------
PLAIN = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
WITH_TOOLS = "<tools>{{ tools | tojson }}</tools>\n" + PLAIN
MESSAGES = [{"role": "user", "content": "weather?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _tokenizer(path, config=None, files=None):
    from scheduler.tokenizer import HFTokenizer
    from tokenizer_files import write_byte_tokenizer
    write_byte_tokenizer(path, config=config)
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text, encoding="utf-8")
    return HFTokenizer(str(path))


def _render(tok, tools=None) -> str:
    return tok.decode(tok.apply_chat_template(MESSAGES, tools=tools), skip_special_tokens=False)


@pytest.mark.parametrize("where", ["config", "files"])
def test_a_tool_use_template_renders_the_chats_that_send_tools(tmp_path, where):
    """Checkpoints such as Hermes-2-Pro ship named templates, "default" and "tool_use": transformers picks tool_use
    for a chat with tools (get_chat_template(tools=...)), as vLLM does; the default was always used, and the tools
    never reached the prompt."""
    if where == "config":
        tok = _tokenizer(tmp_path, {"chat_template": [{"name": "default", "template": PLAIN},
                                                      {"name": "tool_use", "template": WITH_TOOLS}]})
    else:
        tok = _tokenizer(tmp_path, {}, {"chat_template.jinja": PLAIN,
                                         "additional_chat_templates/tool_use.jinja": WITH_TOOLS})
    assert _render(tok) == "<user>weather?\n<assistant>"
    assert _render(tok, TOOLS).startswith('<tools>[{"type": "function"') and "get_weather" in _render(tok, TOOLS)
    tok.use_chat_template(PLAIN)  # (--chat-template: the one template, tools or not)
    assert _render(tok, TOOLS) == "<user>weather?\n<assistant>"


def test_a_tool_use_template_that_does_not_compile_refuses_only_chats_with_tools(tmp_path):
    tok = _tokenizer(tmp_path, {"chat_template": [{"name": "default", "template": PLAIN},
                                                  {"name": "tool_use", "template": "{% if %}"}]})
    assert _render(tok) == "<user>weather?\n<assistant>"
    with pytest.raises(ValueError, match="tool_use"):
        _render(tok, TOOLS)


def test_chat_template_jinja_wins_over_the_config_s_template(tmp_path):
    """transformers: "If independent chat template file(s) exist, they take priority over template entries in the
    tokenizer config"; the config's (stale) template was used."""
    tok = _tokenizer(tmp_path, {"chat_template": "OLD:{{ messages[0]['content'] }}"},
                     {"chat_template.jinja": "NEW:{{ messages[0]['content'] }}"})
    assert _render(tok) == "NEW:weather?"


def test_template_and_config_files_are_read_as_utf8_whatever_the_locale(tmp_path):
    """Read in the locale's encoding, a "»" in chat_template.jinja failed the tokenizer's load under LC_ALL=C (an
    ascii codec error at start), and read as mojibake under latin-1."""
    import subprocess
    import sys
    _tokenizer(tmp_path, {"bos_token": "«"}, {"chat_template.jinja": "» {{ messages[0]['content'] }}"})
    code = ("import sys; sys.path.insert(0, '.'); from scheduler.tokenizer import HFTokenizer; "
            f"t = HFTokenizer({str(tmp_path)!r}); "
            "print(ascii(t.decode(t.apply_chat_template([{'role': 'user', 'content': 'hi'}]), False)))")
    env = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ascii("» hi")

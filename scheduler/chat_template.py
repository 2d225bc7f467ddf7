"""A chat template (Jinja, as transformers renders it) turned into a prompt's text, for either tokenizer
(scheduler/tokenizer.py): a checkpoint's own (tokenizer_config.json or chat_template.jinja) or the server's
`--chat-template` (vLLM's flag: a file, or the template itself), which also gives the presets' byte tokenizer
a chat.

The template sees what transformers gives it: the request's tools (None without), documents=None, the special
tokens the tokenizer defines (bos / eos "" when it has none), raise_exception, strftime_now, and a `tojson`
that does not HTML-escape. A "developer" message is rendered as a "system" one unless the template names the
role. continue_final_message cuts the text where the last message's content ends, for the model to go on.
"""
from __future__ import annotations

import datetime
import json
import os


MAX_RENDERED_CHARS = 16 << 20  # a rendered chat's text, far past any prompt a model takes


class ChatTemplate:
    """A compiled template; `render` makes the text. ValueError where it does not compile (or jinja2 is
    missing), with why."""

    def __init__(self, template: str, special_tokens: dict | None = None) -> None:
        try:
            self._compiled = _compile(template)
        except ImportError:
            raise ValueError("jinja2 is not installed, so the chat template cannot be rendered") from None
        except Exception as exc:  # jinja2.TemplateError
            raise ValueError(f"the chat template does not compile here: {exc}") from None
        self.text = template
        self.special_tokens = dict(special_tokens or {})
        # OpenAI's "developer" messages are its newer system messages: a template that never names the role
        # (Qwen's renders system / user / assistant / tool) dropped them silently, so they reach it as "system";
        # one that names it (gpt-oss's) gets them as they are
        self.developer_as_system = "developer" not in template

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
        if self.developer_as_system:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        # what transformers passes: tools / documents None, not undefined (`tools is not none`), without any; and
        # the tokenizer's special tokens (bos / eos "" rather than undefined); one dict, not keyword arguments
        # (regression: a template_kwargs key "self" was render()'s own, a TypeError)
        pieces, length = [], 0
        for piece in self._compiled.generate({**(template_kwargs or {}), "messages": messages, "tools": tools,
                                              "documents": None, "add_generation_prompt": add_generation_prompt,
                                              "bos_token": "", "eos_token": "", **self.special_tokens}):
            pieces.append(piece)
            length += len(piece)
            if length > MAX_RENDERED_CHARS:  # (regression: a request's own template, trusted, of nested loops
                # rendered 100 M characters, 1.5 GB, on the server's loop)
                raise ValueError(f"the chat template rendered more than {MAX_RENDERED_CHARS:,} characters")
        text = "".join(pieces)
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1].get("content") or "")
        return text


def read_chat_template(arg: str) -> str:
    """vLLM's --chat-template: a file's text, or the argument itself where it reads as a template (it has
    "{" or a line break); ValueError for what looks like a path to no file."""
    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as f:
            return f.read()
    if any(ch in arg for ch in "{}\n"):
        return arg
    raise ValueError(f"--chat-template {arg!r} is neither a file nor a template")


def _cut_after_final_message(text: str, content: str) -> str:
    """`text` up to the end of the final message's `content` (transformers' continue_final_message: its
    content stripped where the template strips it)."""
    if content.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat "
                         "after applying the chat template")
    at = text.rindex(content.strip())
    if text[at:at + len(content.lstrip())] == content:  # the template kept the content's trailing space
        return text[:at + len(content.lstrip())]
    return text[:at + len(content.strip())]


def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # (jinja's own tojson HTML-escapes <, >, &, ' and ASCII-escapes the rest: not the text models saw)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])  # as transformers renders
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    return env.from_string(template)

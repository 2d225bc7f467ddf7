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

import codecs
import datetime
import json
import os


# vLLM's --chat-template-content-format: how a message's content reaches the template (`ChatTemplate.content_format`)
CONTENT_FORMATS = ("auto", "string", "openai")
MAX_RENDERED_CHARS = 16 << 20  # a rendered chat's text, far past any prompt a model takes
# transformers' mark of where the final message's content ends, written after it before the render
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


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
        # how messages' content reaches it, as vLLM's --chat-template-content-format auto reads it off the template
        # (regression: a template over the content's parts, Llama 4's or SmolVLM's, iterated a string's characters)
        self.content_format = _content_format(self._compiled.environment.parse(template))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
        if self.developer_as_system:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        content = messages[-1].get("content") if continue_final_message else ""
        if isinstance(content, list):  # ("openai" content: its last text part goes on, as transformers' does)
            at = next((i for i in reversed(range(len(content))) if "text" in content[i]), None)
            if at is None:
                raise ValueError("continue_final_message is set but the final message has no text to continue")
            parts, content = list(content), content[at]["text"]
            parts[at] = {**parts[at], "text": content + CONTINUE_TAG}
            messages = [*messages[:-1], {**messages[-1], "content": parts}]
        elif continue_final_message:  # (regression: the cut came after the content's last occurrence in the text,
            # so an empty content left the turn closed and a "<" was found inside the turn's closing "<|im_end|>")
            content = content or ""
            messages = [*messages[:-1], {**messages[-1], "content": content + CONTINUE_TAG}]
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
            text = _cut_after_final_message(text, content)
        return text


def read_chat_template(arg: str) -> str:
    """vLLM's --chat-template: a file's text, or the argument itself where it reads as a template (it has
    "{" or a line break), its backslash escapes decoded as vLLM decodes them (a shell's '...\\n...' is a line
    break: regression, a backslash and an "n" were written into every prompt), its other text kept (where vLLM's
    unicode_escape read UTF-8 as Latin-1); ValueError for what looks like a path to no file."""
    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as f:
            return f.read()
    if any(ch in arg for ch in "{}\n"):
        try:
            return codecs.decode(arg.encode("latin-1", "backslashreplace"), "unicode_escape")
        except UnicodeDecodeError as exc:
            raise ValueError(f"--chat-template: a backslash escape of the template does not decode: {exc}") from None
    raise ValueError(f"--chat-template {arg!r} is neither a file nor a template")


def _cut_after_final_message(text: str, content: str) -> str:
    """`text`, rendered with CONTINUE_TAG after the final message's `content`, up to where the content ends
    (transformers' continue_final_message: its trailing space stripped where the template strips it)."""
    if content.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat "
                         "after applying the chat template")
    at = text.rindex(CONTINUE_TAG.strip())
    if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG:  # the template kept the content's trailing space
        return text[:at]
    return text[:at].rstrip()


def _content_format(ast) -> str:
    """vLLM's reading of a template's content format (vllm/renderers/hf.py, _detect_content_format): "openai" where
    it loops over a message's content (`{% for item in message['content'] %}`, the message a loop's variable over
    `messages` or over a name set from it, through filters and slices) or over a name `content` (a macro's
    argument, Qwen3.5's); "string" otherwise, and where vLLM's search cannot tell (a loop or a set of two names)."""
    from jinja2 import nodes

    names, todo = {"messages"}, ["messages"]
    while todo:  # the names set from `messages` (vLLM's search went round a cycle of them for good)
        name = todo.pop()
        for assign in ast.find_all(nodes.Assign):
            if _reads(assign.node, name):
                if not isinstance(assign.target, nodes.Name):
                    return "string"
                if assign.target.name not in names:
                    names.add(assign.target.name)
                    todo.append(assign.target.name)
    message_names = set()
    for loop in ast.find_all(nodes.For):
        if any(_reads(loop.iter, name) for name in names):
            if not isinstance(loop.target, nodes.Name):
                return "string"
            message_names.add(loop.target.name)
    for loop in ast.find_all(nodes.For):
        if any(_reads(loop.iter, name, "content") for name in message_names) or (
                isinstance(loop.iter, nodes.Name) and loop.iter.name == "content"):
            return "openai" if isinstance(loop.target, nodes.Name) else "string"
    return "string"


def _reads(node, name: str, key: str | None = None) -> bool:
    """`node` is the variable `name` (with `key`: its item or attribute `key`), through filters, tests and slices."""
    from jinja2 import nodes

    sliced = isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    if sliced or isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if key is not None:
        if not (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key
                or isinstance(node, nodes.Getattr) and node.attr == key):
            return False
        node = node.node
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _compile(template: str):
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for TRL's
        assistant-only loss), its body rendered as it is. (Regression: "unknown tag 'generation'", a checkpoint
        whose template has it served no chat.)"""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # (jinja's own tojson HTML-escapes <, >, &, ' and ASCII-escapes the rest: not the text models saw)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])  # as transformers renders
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    return env.from_string(template)

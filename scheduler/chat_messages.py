"""A chat completion's `messages` (api_models.ChatCompletionRequest's, /tokenize's chat form): OpenAI's roles and
text content, an assistant's calls (scheduler/api_tools.py) and its thinking sent back, and what a message becomes
for the chat template (`as_template_dict`, as transformers passes a message)."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from scheduler.api_tools import MessageToolCall


class _Strict(BaseModel):  # (api_models._Strict's config; that module imports this one)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


# OpenAI's assistant-message fields at the values that change nothing; the SDK's `parsed` (its own parse of the
# content by a pydantic response_format) at any (regression: a message `.parse()` returned, sent back, was a 400)
_MESSAGE_NEUTRAL: dict[str, tuple] = {"refusal": (None,), "annotations": (None, []), "audio": (None,),
                                      "function_call": (None,)}
_MESSAGE_IGNORED = ("parsed",)


class ChatMessage(_Strict):
    """The OpenAI API's roles; only an assistant's message may come without content (400 otherwise:
    a typo'd role or a forgotten content used to be rendered into a prompt the model never saw), and only
    an assistant's may carry `tool_calls` (the calls it made: scheduler/api_tools.py)."""
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None  # (the SDK's tool messages need it: it was an 'unknown field')
    tool_calls: list[MessageToolCall] | None = None
    reasoning_content: StrictStr | None = None  # (a --reasoning-parser response's, sent back: Qwen3's template reads)
    reasoning: StrictStr | None = None  # vLLM's newer name for it (an agent replaying vLLM's messages sends this one)

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        # an image part was a 400 listing every union branch's complaint; the type's repr: a lone surrogate was a 500
        parts = data.get("content") if isinstance(data, dict) else None
        for part in parts if isinstance(parts, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError("unsupported_value", "content parts of type {kind} are not supported (this "
                                          "server takes text only: 'text' parts or a string)", {"kind": repr(kind)})
        # an assistant message the openai SDK built (its stream helper's, model_dump()) carries these at
        # null, and a conversation sends it back (a 400 "unknown field 'messages.1.refusal'")
        if isinstance(data, dict) and any(k in data for k in (*_MESSAGE_NEUTRAL, *_MESSAGE_IGNORED)):
            for key, neutral in _MESSAGE_NEUTRAL.items():
                value = data.get(key)
                if not any(value == v and type(value) is type(v) for v in neutral):
                    raise PydanticCustomError("unsupported_value", "'{key}' is not supported (only {neutral})",
                                              {"key": key, "neutral": " or ".join(json.dumps(v) for v in neutral)})
            data = {k: v for k, v in data.items() if k not in _MESSAGE_NEUTRAL and k not in _MESSAGE_IGNORED}
        return data

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message may not carry 'tool_calls' (an assistant's may)")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError("'reasoning' and 'reasoning_content' name one thing: give one, or both the same")
        return self

    def as_template_dict(self, content_format: str = "string") -> dict:
        """The message as vLLM hands it to a template of `content_format` (scheduler/chat_template.py's): "string",
        its text parts joined by line breaks, an empty one left out; "openai", OpenAI's list of parts (a string: one
        part), but a tool's joined (vLLM's: most templates take a tool result as a string)."""
        texts = [self.content] if isinstance(self.content, str) else [p.text for p in self.content or ()]
        if content_format == "openai" and self.role != "tool":
            content: str | list[dict] = [{"type": "text", "text": text} for text in texts]
        else:
            content = "\n".join(text for text in texts if text or content_format == "openai")
        out: dict[str, Any] = {"role": self.role, "content": content}
        for key in ("name", "tool_call_id"):  # (as transformers passes a message: a template may use them)
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        thinking = self.reasoning_content if self.reasoning is None else self.reasoning
        if thinking is not None:  # under both names, as vLLM passes it (Qwen3's template reads reasoning_content)
            out["reasoning_content"] = out["reasoning"] = thinking
        if self.tool_calls:
            out["tool_calls"] = [c.as_template_dict() for c in self.tool_calls]
        return out

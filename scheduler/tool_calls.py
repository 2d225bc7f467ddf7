"""Tool calls read out of a chat answer's text (`--tool-call-parser hermes`, vLLM's flag and name).

Qwen2.5 / Qwen3 (and Hermes 2 Pro, whose format it is) write each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`HermesToolParser` takes an answer's text deltas (after the reasoning split, scheduler/reasoning.py) and
gives (content, calls): each block whose body is a JSON object with a string "name" becomes a `ToolCall`
(its "arguments", or "parameters", as JSON text); the text around the blocks is content. One state machine
serves a stream and a whole response, so a stream's content deltas add up to the whole response's:

* whitespace just before a block and just after one is dropped (the model's line breaks between its text and
  its calls); an answer without calls keeps its text exactly, trailing whitespace included;
* a block whose body is not such an object is text (content, markers and all): nothing the model wrote is lost;
* a block cut off (max_tokens, or a model that stops without "</tool_call>") is a call if its body is whole
  JSON, else text;
* a marker split over deltas is held back until it can be told apart from text (as stop strings are).
"""
from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes",)  # vLLM's name; Qwen2.5's and Qwen3's templates write this format
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # (OpenAI's form: "call_" and 24 characters)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = field(default_factory=new_call_id)

    def as_dict(self) -> dict:
        """The call as a message's `tool_calls` item (a stream's adds its "index")."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_of(body: str) -> ToolCall | None:
    """A block's body as a call: a JSON object with a string "name" and object (or JSON text) "arguments"
    ("parameters" as some fine-tunes write it; none: {}); None when it is not one."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # (already JSON text)
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


class Mode(enum.Enum):
    TEXT = "text"  # content, watching for CALL_START
    CALL = "call"  # inside a block, its body gathered until CALL_END


class HermesToolParser:
    """Content deltas in, (content, calls) out; `called` once any call was made."""

    def __init__(self) -> None:
        self.mode, self.called = Mode.TEXT, False
        self._held = ""        # text that may be the start of CALL_START
        self._space = ""       # whitespace after the content sent so far: sent once more content follows
        self._space_before_call = ""  # (given back as text if the block turns out not to be a call)
        self._after_call = False  # the whitespace that follows a block is dropped
        self._body = ""

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        text, self._held = self._held + delta, ""
        content, calls = [], []
        while text:
            if self.mode is Mode.TEXT:
                at = text.find(CALL_START)
                if at < 0:
                    keep = _partial_suffix(text, CALL_START)
                    content.append(self._content(text[:len(text) - keep]))
                    self._held = text[len(text) - keep:]
                    break
                content.append(self._content(text[:at]))
                self._space_before_call, self._space = self._space, ""
                self.mode, text = Mode.CALL, text[at + len(CALL_START):]
            else:
                self._body += text
                at = self._body.find(CALL_END)
                if at < 0:
                    break
                body, text = self._body[:at], self._body[at + len(CALL_END):]
                self._body, self.mode = "", Mode.TEXT
                content.append(self._block(body, CALL_END, calls))
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """The end of the answer: a block left open is a call if its body is whole, held text is text."""
        calls: list[ToolCall] = []
        if self.mode is Mode.CALL:
            self.mode, body, self._body = Mode.TEXT, self._body, ""
            content = self._block(body, "", calls)
        else:
            content = self._content(self._held)
        self._held, space, self._space = "", self._space, ""
        return content + space, calls

    def _block(self, body: str, end: str, calls: list[ToolCall]) -> str:
        call = call_of(body)
        if call is None:  # text after all, with the whitespace before it
            self._space = self._space_before_call
            return self._content(CALL_START + body + end)
        calls.append(call)
        self.called = self._after_call = True
        return ""

    def _content(self, piece: str) -> str:
        """Text to send now: whitespace at its end waits for what follows (dropped before a block)."""
        if self._after_call:
            piece = piece.lstrip()
            if not piece:
                return ""
            self._after_call = False
        text = self._space + piece
        sent = text.rstrip()
        self._space = text[len(sent):]
        return sent


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    return next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[len(text) - k:])),
                0)

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
  its calls); text that follows calls which followed text is joined to it by the whitespace that text ended
  with (its line break, or its space: none, where it ended with none); an answer without calls keeps its text
  exactly, trailing whitespace included;
* a block whose body is not such an object is text (content, markers and all): nothing the model wrote is lost;
* a block cut off (max_tokens, or a model that stops without "</tool_call>") is a call if its body is whole
  JSON, else text;
* a "</tool_call>" inside a string of a body that is a JSON object is the string's text, not the block's end
  (an argument may hold one: code, a prompt; vLLM's regex ends the block there, and the call was content); a
  block that turns out to be no call all the same (an unclosed string) ends at its first "</tool_call>", as
  before, and the text after that is read again, the calls in it calls (once an answer: a second such block
  is text through its end, so that no text is read more than twice);
* a marker split over deltas is held back until it can be told apart from text (as stop strings are).
"""
from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes",)  # vLLM's name; Qwen2.5's and Qwen3's templates write this format
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_BODY_MARKS = re.compile(r'\\.|["\\]|' + re.escape(CALL_END), re.S)  # an escape, a quote or a lone backslash, the end


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


class _Number:
    """A JSON number as the model wrote it (`loads_keeping_numbers`)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def loads_keeping_numbers(text: str) -> Any:
    """json.loads with each number kept as its text (a `_Number`), so that `json_text` writes it back as it came
    (regression: a number past a double's range, 1E999, came back as Infinity, which is not JSON)."""
    return json.loads(text, parse_float=_Number, parse_int=_Number)


def json_text(value: Any) -> str:
    """`value` (from `loads_keeping_numbers`) as JSON text, as json.dumps(ensure_ascii=False) writes it, its
    numbers as they came."""
    if isinstance(value, _Number):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(json_text(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def call_of(body: str) -> ToolCall | None:
    """A block's body as a call: a JSON object with a string "name" and object "arguments" (or JSON text of one;
    "parameters" as some fine-tunes write it; none or null: {}); None when it is not one (regression: a string of no
    JSON, "hello", was taken as the call's arguments: not the JSON text a client parses)."""
    try:
        obj = loads_keeping_numbers(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # (JSON text of the arguments)
        try:
            args = loads_keeping_numbers(args)
        except (ValueError, RecursionError):
            return None
    if args is None:  # null: none, as a request's null arguments read (regression: the call was content text)
        args = {}
    try:
        return ToolCall(obj["name"], json_text(args)) if isinstance(args, dict) else None
    except RecursionError:  # (nested deeper than json_text writes back, ~330 levels: text, as JSON past the parser's)
        return None


class Mode(enum.Enum):
    TEXT = "text"  # content, watching for CALL_START
    CALL = "call"  # inside a block, its body gathered until CALL_END


class HermesToolParser:
    """Content deltas in, (content, calls) out; `called` once any call was made."""

    def __init__(self) -> None:
        self.mode, self.called = Mode.TEXT, False
        self._held = ""        # text that may be the start of a marker (or a string's escape) not yet read
        self._space = ""       # whitespace after the content sent so far: sent once more content follows
        self._space_before_call = ""  # (given back as text if the block turns out not to be a call)
        self._after_call = False  # the whitespace that follows a block is dropped
        self._gap = ""  # the whitespace the text before a run of calls ended with: it joins the text after them
        # the open block's body: its parts so far (regression: one string, grown and searched whole at each
        # delta: quadratic, ~6 s of the loop for a 200 KB call in 1-character deltas), and how it is read
        self._body: list[str] = []
        self._body_chars = 0
        self._json: bool | None = None  # the body is a JSON object (None: whitespace so far)
        self._quoted = False  # the reading is inside one of its strings
        self._inner_end: int | None = None  # where the first CALL_END inside a string is in the body
        self._may_reread = True  # (once an answer: text read again is read in linear time)

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
                if not self._after_call:  # (a run's first block: the calls back to back keep its gap)
                    self._gap = self._space
                self._space_before_call, self._space = self._space, ""
                self.mode, text = Mode.CALL, text[at + len(CALL_START):]
                self._body, self._body_chars, self._json, self._quoted, self._inner_end = [], 0, None, False, None
            else:
                at, read = self._read_body(text)
                self._body.append(text[:read])
                self._body_chars += read
                if at < 0:
                    self._held = text[read:]
                    break
                body, text = "".join(self._body), text[at + len(CALL_END):]
                self._body, self.mode = [], Mode.TEXT
                piece, again = self._block(body, CALL_END, calls)
                content.append(piece)
                text = again + text
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """The end of the answer: a block left open is a call if its body is whole, held text is text."""
        content: list[str] = []
        calls: list[ToolCall] = []
        while self.mode is Mode.CALL:  # (twice at most: a broken block's text read again may leave one open)
            self.mode, body, self._body, self._held = Mode.TEXT, "".join(self._body) + self._held, [], ""
            piece, again = self._block(body, "", calls)
            more, more_calls = self.feed(again) if again else ("", [])
            content += [piece, more]
            calls += more_calls
        content.append(self._content(self._held))
        self._held, space, self._space = "", self._space, ""
        return "".join(content) + space, calls

    def _read_body(self, text: str) -> tuple[int, int]:
        """(where the block's CALL_END starts in `text`, the body's next part, or -1; how much of `text` was read
        into the body): past the strings of a JSON object body. What may begin a marker or an escape is left
        unread (held for the next delta), so any deltas read alike."""
        if self._json is None and text.strip():
            self._json = text.lstrip().startswith("{")
        pos = 0
        while (m := _BODY_MARKS.search(text, pos)) is not None:
            mark, strings = m.group(), self._json
            if mark == CALL_END:
                if not (strings and self._quoted):
                    return m.start(), m.start()
                if self._inner_end is None:
                    self._inner_end = self._body_chars + m.start()
            elif mark == '"':
                self._quoted = self._quoted != bool(strings)
            elif not (strings and self._quoted):  # (a backslash outside a string escapes nothing)
                pos = m.start() + 1
                continue
            elif mark == "\\":  # an escape whose character is still to come
                return -1, m.start()
            pos = m.end()
        return -1, len(text) - _partial_suffix(text[pos:], CALL_END)

    def _block(self, body: str, end: str, calls: list[ToolCall]) -> tuple[str, str]:
        """(the content a closed block makes, text to read again: what followed the first CALL_END of a block
        that is no call, where that CALL_END was inside a string)."""
        call = call_of(body)
        if call is not None:
            calls.append(call)
            self.called = self._after_call = True
            return "", ""
        again = ""
        if self._inner_end is not None and self._may_reread:  # (it ends there after all, as text)
            body, again, end = body[:self._inner_end], body[self._inner_end + len(CALL_END):] + end, CALL_END
            self._may_reread = False
        self._space = self._space_before_call  # text after all, with the whitespace before it
        return self._content(CALL_START + body + end), again

    def _content(self, piece: str) -> str:
        """Text to send now: whitespace at its end waits for what follows (dropped before a block)."""
        if self._after_call:
            piece = piece.lstrip()
            if not piece:
                return ""
            # (regression: text on both sides of calls was joined with nothing between, "check.Done.")
            piece, self._gap, self._after_call = self._gap + piece, "", False
        text = self._space + piece
        sent = text.rstrip()
        self._space = text[len(sent):]
        return sent


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    return next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[len(text) - k:])),
                0)

"""A chat choice's text made into its message (scheduler/choices.py): the thinking split off as
`reasoning_content` (--reasoning-parser, scheduler/reasoning.py), then the tool calls read out of the rest
(scheduler/api_tools.py's tool_choice):

* "auto": the server's parser (scheduler/tool_calls.py) finds the calls in the text; the text around them is
  the content;
* "required": the text is a JSON list of calls (its grammar held it to one): the calls, made at the end (a
  list cut off by max_tokens is the content, as text);
* a named function: the text is its call's arguments; a stream sends the call's id and name first, then
  the arguments as they come (OpenAI's deltas).

One `ChatAnswer` serves a stream (`feed` each delta, `flush` at the end) and a whole response (`whole`)
alike, so a stream's deltas add up to the whole message. A message with calls has finish_reason
"tool_calls" where the answer stopped by itself (auto and required; a named function's is "stop", as
OpenAI's), and null content where it has no text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.api_tools import ToolMode, required_calls
from scheduler.reasoning import ReasoningSplitter
from scheduler.tool_calls import HermesToolParser, ToolCall, new_call_id


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)  # a stream's tool_calls deltas (each with its "index")

    def __add__(self, other: "Delta") -> "Delta":
        return Delta(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


class ChatAnswer:
    """One chat choice's message, made as its text arrives. splitter: the reasoning split, or None; mode: the
    request's tool mode; named: the function a named tool_choice calls; single: parallel_tool_calls false."""

    def __init__(self, splitter: ReasoningSplitter | None, mode: ToolMode = "none", named: str | None = None,
                 single: bool = False) -> None:
        self.splitter, self.mode, self.named, self.single = splitter, mode, named, single
        self.parser = HermesToolParser() if mode == "auto" else None
        self.calls: list[ToolCall] = []  # whole calls, in order (a named one's arguments: `_arguments`)
        self._text: list[str] = []  # a required list's text, read at the end (in parts: regression, one string
        # grown at each delta was copied whole each time, quadratic in a long list)
        self._arguments: list[str] = []
        self._named_id = new_call_id()

    @property
    def reasoned(self) -> bool:
        return self.splitter is not None and self.splitter.reasoned

    def feed(self, text: str) -> Delta:
        reasoning, content = self.splitter.feed(text) if self.splitter is not None else ("", text)
        return Delta(reasoning) + self._tools(content)

    def flush(self) -> Delta:
        reasoning, content = self.splitter.flush() if self.splitter is not None else ("", "")
        out = Delta(reasoning) + self._tools(content)
        if self.parser is not None:
            content, calls = self.parser.flush()
            out += Delta(content=content, calls=self._made(calls))
        elif self.mode == "required":
            text = "".join(self._text)
            calls = required_calls(text)
            out += Delta(content=text) if calls is None else Delta(calls=self._made(calls))
        return out

    def whole(self, text: str) -> tuple[str | None, str | None, list[dict]]:
        """A whole answer's (reasoning_content: None where it did not think, content: None where calls or a thought
        left no text, as vLLM's parsers return it; tool_calls)."""
        delta = self.feed(text) + self.flush()
        calls = [c.as_dict() for c in self.calls]
        if self.mode == "named":
            calls = [ToolCall(self.named, "".join(self._arguments), self._named_id).as_dict()]
        content = delta.content or None if calls or self.reasoned else delta.content
        return (delta.reasoning if self.reasoned else None), content, calls

    def finish_reason(self, reason: str) -> str:
        called = self.calls and self.mode in ("auto", "required")
        return "tool_calls" if called and reason == "stop" else reason

    def _tools(self, content: str) -> Delta:
        if self.parser is not None:
            content, calls = self.parser.feed(content)
            return Delta(content=content, calls=self._made(calls))
        if self.mode == "required":
            self._text.append(content)
            return Delta()
        if self.mode == "named":  # (the first delta names the call, even before any argument text)
            first = not self._arguments
            self._arguments.append(content)
            if not (first or content):
                return Delta()
            call = {"index": 0, "function": {"arguments": content}}
            if first:
                call = {"index": 0, "id": self._named_id, "type": "function",
                        "function": {"name": self.named, "arguments": content}}
            return Delta(calls=[call])
        return Delta(content=content)

    def _made(self, calls: list[ToolCall]) -> list[dict]:
        """New whole calls as stream deltas; past the first with parallel_tool_calls false, none."""
        if self.single:
            calls = calls[:max(0, 1 - len(self.calls))]
        deltas = [{"index": len(self.calls) + i, **c.as_dict()} for i, c in enumerate(calls)]
        self.calls += calls
        return deltas

"""A chat answer's thinking split from its answer (`--reasoning-parser`, vLLM's flag and field).

Qwen3 and DeepSeek-R1 think first: "<think>" ... "</think>", then the answer. With a parser on, a chat
response's message carries the thinking as `reasoning_content` and the rest as `content` (a stream's deltas
likewise: each chunk's text goes to one or both); without one the text is all `content`, markers and all.

The split is made on the choice's text as it is sent (after stop strings), by one state machine that a
stream and a whole response run alike, so a stream's deltas add up to the whole response's fields:

* an answer that starts with "<think>" thinks until "</think>"; the markers themselves are dropped;
* a prompt that leaves a think block open (Qwen3-Thinking-2507's and DeepSeek-R1's templates end the
  prompt with "<think>\\n"; a continued final message may hold a thought begun) starts the answer thinking
  (a "<think>" it starts with all the same is dropped);
* an answer that never thinks (Qwen3 with enable_thinking false: the template closed an empty block
  in the prompt) is all content, and so is the rest after "</think>";
* a thought cut off (max_tokens) stays reasoning, with no content.

A marker split over several deltas is held back until it can be told apart from text, as stop strings are
(scheduler/stop_strings.py). Completions are never split (vLLM's parsers serve chat only).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence

PARSERS = ("qwen3", "deepseek_r1")  # vLLM's names; both think in <think> ... </think>
THINK_START, THINK_END = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 16  # how much of a prompt's end is decoded to see whether it left a think block open


class Mode(enum.Enum):
    START = "start"          # nothing decided: the answer may open a think block
    REASONING = "reasoning"  # inside the think block
    CONTENT = "content"      # the answer proper


def opens_thinking(prompt_tail_text: str) -> bool:
    """Whether a prompt's text (its end suffices) leaves a think block open for the answer."""
    return prompt_tail_text.rfind(THINK_START) > prompt_tail_text.rfind(THINK_END)


def prompt_opens_thinking(tokenizer, prompt: Sequence[int], continued: str | None = None) -> bool:
    """Whether a chat's prompt (token ids) leaves a think block open: its last PROMPT_TAIL_TOKENS are looked
    at, and all of the final message when the answer continues it (continue_final_message: `continued`, its
    content; regression: a thought the client began, longer than those few tokens, was not seen open, so the
    answer was all content, its "</think>" in it)."""
    tail_tokens = PROMPT_TAIL_TOKENS
    if continued:
        tail_tokens += len(tokenizer.encode(continued, add_special_tokens=False))
    return opens_thinking(tokenizer.decode(prompt[-tail_tokens:], skip_special_tokens=False))


class ReasoningSplitter:
    """Text deltas in, (reasoning, content) deltas out; `reasoned` once any text went to reasoning."""

    def __init__(self, thinking: bool = False) -> None:
        # (a prompt that opened the block starts in START too: a model that opens it again has that "<think>"
        # dropped, as vLLM's parsers drop it; regression: it began the reasoning_content)
        self.mode, self.thinking = Mode.START, thinking
        self.reasoned = thinking
        self._held = ""  # text that may still be (the start of) the marker the mode waits for

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        if self.mode is Mode.START:
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                self.mode, self.reasoned = Mode.REASONING, True
                text = stripped[len(THINK_START):]
            elif THINK_START.startswith(stripped):  # ("" too: whitespace alone decides nothing)
                self._held = text
                return "", ""
            else:
                self.mode = Mode.REASONING if self.thinking else Mode.CONTENT
        if self.mode is Mode.CONTENT:
            return "", text
        at = text.find(THINK_END)
        if at >= 0:
            self.mode = Mode.CONTENT
            return text[:at], text[at + len(THINK_END):]
        keep = next((k for k in range(min(len(text), len(THINK_END) - 1), 0, -1)
                     if THINK_END.startswith(text[len(text) - k:])), 0)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def flush(self) -> tuple[str, str]:
        """What is held at the end: part of a marker that never completed is text of the mode it was in."""
        held, self._held = self._held, ""
        thought = self.mode is Mode.REASONING or (self.mode is Mode.START and self.thinking)
        return (held, "") if thought else ("", held)

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer's (reasoning, content)."""
        reasoning, content = self.feed(text)
        tail_reasoning, tail_content = self.flush()
        return reasoning + tail_reasoning, content + tail_content

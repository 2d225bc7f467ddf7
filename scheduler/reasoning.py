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

The thought's size in tokens (usage's reasoning_tokens: a chat's completion_tokens_details, a Response's
output_tokens_details) is counted from the answer's token ids, not its text re-tokenized: `ReasoningTokens` runs
the same machine over ids, the markers found by their ids (`think_markers`, looked up once per tokenizer), so it
counts the ids the reasoning text is made of, markers left out (vLLM's count_reasoning_tokens: the ids between a
"<think>" and a "</think>" the answer writes; here also from the first id where the prompt opened the block).
"""
from __future__ import annotations

import enum
import contextlib
from collections.abc import Iterable, Sequence

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


class ThinkMarkers:
    """The think markers' token ids in one tokenizer (one id each in Qwen3's and DeepSeek-R1's; a tokenizer
    without them spells each in several ids), and which ids are whitespace alone (memoized: the few an answer
    starts with are looked at)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.start = tuple(tokenizer.encode(THINK_START, add_special_tokens=False))
        self.end = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
        self._blank: dict[int, bool] = {}

    def blank(self, token_id: int) -> bool:
        known = self._blank.get(token_id)
        if known is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            known = self._blank[token_id] = not text.strip()
        return known


def think_markers(tokenizer) -> ThinkMarkers:
    """`tokenizer`'s ThinkMarkers, made once and kept by the tokenizer itself (regression, session 58's hunt: an
    lru_cache of 16 kept the last 16 tokenizers alive, ~33 MB each at Qwen3's vocabulary, after their servers were
    gone: an in-process user's apps each load one)."""
    markers = getattr(tokenizer, "_think_markers", None)
    if markers is None:
        markers = ThinkMarkers(tokenizer)
        with contextlib.suppress(AttributeError):  # (a tokenizer that takes no attribute: made each time)
            tokenizer._think_markers = markers
    return markers


class ReasoningTokens:
    """A chat answer's reasoning tokens, counted from its token ids as they arrive: those of the text that
    ReasoningSplitter(thinking) makes reasoning, by the same rules (a "<think>" after leading whitespace only,
    then up to "</think>"; from the first id where the prompt opened the block), the markers and the whitespace
    before a "<think>" not counted. `counted`: the ids settled so far; `total()`: the count at the answer's end."""

    def __init__(self, markers: ThinkMarkers, thinking: bool = False) -> None:
        self.markers, self.thinking = markers, thinking
        self.mode = Mode.START
        self.counted = 0
        self._held: list[int] = []  # ids that may still be (the start of) the marker the mode waits for
        self._blank_ids = 0  # whitespace ids before the answer's first text (START)

    def feed(self, token_ids: Iterable[int]) -> None:
        for token_id in token_ids:
            if self.mode is Mode.START:
                self._start(token_id)
            elif self.mode is Mode.REASONING:
                self._reason(token_id)

    def total(self) -> int:
        """What is held at the end is of the mode it was in (as ReasoningSplitter.flush)."""
        if self.mode is Mode.REASONING:
            return self.counted + len(self._held)
        if self.mode is Mode.START and self.thinking:
            return self._blank_ids + len(self._held)
        return self.counted

    def _start(self, token_id: int) -> None:
        start = self.markers.start
        if not self._held and self.markers.blank(token_id):
            self._blank_ids += 1
            return
        self._held.append(token_id)
        if tuple(self._held) == start[:len(self._held)]:
            if len(self._held) == len(start):  # the answer opened the block: its marker and the whitespace
                self.mode, self._held, self._blank_ids = Mode.REASONING, [], 0  # before it are not thought
            return
        held, blank_ids, self._held, self._blank_ids = self._held, self._blank_ids, [], 0
        if not self.thinking:
            self.mode = Mode.CONTENT
            return
        self.mode, self.counted = Mode.REASONING, blank_ids
        for token_id in held:  # (they may start the end marker)
            self._reason(token_id)

    def _reason(self, token_id: int) -> None:
        end, held = self.markers.end, self._held
        held.append(token_id)
        if tuple(held[-len(end):]) == end:
            self.counted += len(held) - len(end)
            self.mode, self._held = Mode.CONTENT, []
            return
        keep = next((k for k in range(min(len(held), len(end) - 1), 0, -1) if tuple(held[-k:]) == end[:k]), 0)
        self.counted += len(held) - keep
        del held[:len(held) - keep]

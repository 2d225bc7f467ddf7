"""A /v1/responses answer's token logprobs (`include: ["message.output_text.logprobs"]`, `top_logprobs` 0..20
alternatives; scheduler/api_responses.py asks the chat completion that serves it for `logprobs: true,
top_logprobs: k`): which of the chat's per-token entries (scheduler/logprobs.py's chat shape) are the
output_text's, and the shapes Responses gives them in.

* The output_text part (a message item's, `response.content_part.done`'s): the chat's entries as they are,
  {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]} (openai-python's ResponseOutputText.Logprob).
* `response.output_text.delta` / `.done` events: {token, logprob, top_logprobs: [{token, logprob}]}, no bytes
  (openai-python's ResponseTextDeltaEvent.Logprob, as vLLM's); a stream's deltas' add up to the whole text's.

Which tokens are the output_text's (an answer's tokens in order, as its chunks bring them; a whole answer is
one chunk):
* With --reasoning-parser, not the think block's: the ids are classified by scheduler/reasoning.py's
  ReasoningTokens (the rules that split the text), so that the block's tokens, its markers and the blanks
  before a "<think>" are left out exactly, token by token; tokens not yet decided (blanks, a marker's first
  ids) wait. (vLLM's whole response puts every generated token's on the output_text, the thought's too.)
* A chunk whose delta has text takes its tokens and those that waited; one without text or a call (text the
  tool parser holds) leaves them waiting; one with a call and no text drops them (the call's markup and
  arguments, the blanks before it: function_call items carry none). Blanks the tool parser drops after a call
  wait, and go with the text that follows it. A chunk with text and calls (a whole answer's, the hermes
  parser's text around calls) has its tokens read again by the hermes parser one by one, each taken, left
  waiting or dropped as a stream's chunk of that token (so that a whole answer's text, before its calls and
  after them, has the tokens a stream's texts have, in order).
* The answer's last chunk, where the text was the last thing written (no call since): the tokens still waiting
  go to the text, as a whole answer's text takes its tokens of no text (an EOS whose text is left out, an id
  past the tokenizer's, text a stop string cut); in a stream they join the text's last delta
  (responses_output.OutputItems holds each delta back until the next event). Otherwise tokens still waiting at
  the end (a marker never completed, blanks after a call) are dropped.
"""
from __future__ import annotations

from scheduler.reasoning import Mode, ReasoningTokens
from scheduler.tool_calls import HermesToolParser


def event_form(entries: list[dict]) -> list[dict]:
    """Entries as the output_text events carry them: without bytes."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


class AnswerLogprobs:
    """One answer's entries given to its output_text: `feed` a chunk's token ids, their entries and its delta
    (reasoning_content, content, tool_calls), for the entries that go with its content."""

    def __init__(self, counter: ReasoningTokens | None) -> None:
        self.counter = counter  # (None: no --reasoning-parser, every token is text or a call's)
        self._undecided: list[dict] = []  # entries of ids fed while the answer's start was undecided
        self._waiting: list[dict] = []  # the text's entries not yet sent with a delta's content
        self._in_text = False  # whether the last entries given went to text (no call since)

    def feed(self, token_ids: list[int], entries: list[dict], delta: dict, last: bool = False) -> list[dict]:
        """`last`: the answer's last chunk, whose waiting tokens go to the text it is writing, if any."""
        self._waiting += self._texts(token_ids, entries)
        content, calls = delta.get("content") or "", delta.get("tool_calls")
        # (regression: text and calls took the tokens whose pieces spelled the text's start: none of the text
        # after a call, none past a piece of a character of several bytes)
        if content and calls:
            return self._around_calls(last)
        return self._chunk(bool(content), bool(calls), last)

    def _chunk(self, text: bool, call: bool, last: bool) -> list[dict]:
        """The waiting entries a chunk takes: all where it writes text (with a call too: a token of both),
        none where it writes a call (they are dropped); where it writes neither they wait, unless it is the
        last one and the text was written last (regression: a stream's last such tokens were dropped)."""
        if not (text or call or (last and self._in_text)):
            return []
        self._in_text = text or not call
        taken, self._waiting = self._waiting, []
        return taken if self._in_text else []

    def _around_calls(self, last: bool) -> list[dict]:
        """The waiting entries of text around calls, read again by the hermes parser (theirs), token by token."""
        parser, waiting, self._waiting, taken = HermesToolParser(), self._waiting, [], []
        for entry in waiting:
            self._waiting.append(entry)
            content, calls = parser.feed(_piece(entry))
            taken += self._chunk(bool(content), bool(calls), False)
        content, calls = parser.flush()
        return taken + self._chunk(bool(content), bool(calls), last)

    def _texts(self, token_ids: list[int], entries: list[dict]) -> list[dict]:
        """The entries of the ids that are text (not the think block's), as each is decided."""
        counter = self.counter
        if counter is None:
            return list(entries)
        texts = []
        for token_id, entry in zip(token_ids, entries):
            before = counter.mode
            counter.feed([token_id])
            after = counter.mode
            if after is Mode.START:  # (blanks, or the first ids of "<think>": what they are is not known yet)
                self._undecided.append(entry)
            elif before is Mode.START:
                undecided, self._undecided = self._undecided, []
                if after is Mode.CONTENT and not counter.thinking:  # (thinking: the id closed the block)
                    texts += undecided + [entry]
            elif before is Mode.CONTENT:
                texts.append(entry)
        return texts


def _piece(entry: dict) -> str:
    """An entry's token's text ("token_id:N", scheduler/logprobs.py's piece of a token that decodes to nothing:
    none)."""
    return "" if entry["token"].startswith("token_id:") else entry["token"]

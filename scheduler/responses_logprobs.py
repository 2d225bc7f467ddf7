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
  arguments: function_call items carry none). A chunk with text and a call (a whole answer's) takes, from the
  first, the tokens whose pieces spell the text's start and drops the rest, the text before a call being
  written first (the hermes parser's text after a call, in a whole answer, is then not covered; nor is any
  text after a call that opens the answer). Tokens still
  waiting at the end (a marker never completed, text a stop string cut) are dropped.
"""
from __future__ import annotations

from scheduler.reasoning import Mode, ReasoningTokens


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
        """`last`: the answer's last chunk, whose waiting tokens go to the text it is writing, if any (a whole
        answer's text takes its tokens of no text, an id past the tokenizer's, an incomplete character)."""
        self._waiting += self._texts(token_ids, entries)
        content, calls = delta.get("content") or "", delta.get("tool_calls")
        if not content and not calls:
            if not (last and self._in_text):  # (regression: a stream's last such tokens were dropped)
                return []
        self._in_text = not calls
        taken, self._waiting = self._waiting, []
        if calls:  # (the text comes first: the tokens whose pieces spell its start, the rest the calls')
            pieces, kept = "", []
            for entry in taken:  # (regression: those that fitted its length, a call before it gave its markup's)
                pieces += entry["token"]
                if not content.startswith(pieces):
                    break
                kept.append(entry)
            taken = kept
        return taken

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

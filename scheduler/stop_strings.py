"""Stop strings: OpenAI's `stop` given as text, matched on a completion's generated text.

The engine speaks token ids (its `stop_token_ids` end a request at a token); a stop string ends it when
the TEXT generated so far contains it, wherever the tokens split it (one string over several tokens,
or a multi-byte character over several byte tokens: the text is matched after incremental decoding,
`tokenizer.IncrementalDecoder`, so a character is matched once it is whole). Only generated text is
matched, never the prompt's. As OpenAI / vLLM do:

* the text returned ends just before the first (leftmost) match, the stop string left out (with vLLM's
  `include_stop_str_in_output`, just after it);
* the finish_reason is "stop", and vLLM's stop_reason the string that matched (`CompletionText.matched`);
* the tokens counted (usage.completion_tokens, `token_ids`) are those generated up to and including
  the one whose text completed the match (vLLM's count); the server then aborts the engine request.

With vLLM's `min_tokens` (SamplingParams.min_tokens), as vLLM V1's detokenizer: a stop string matches only
once the text of a token past the first min_tokens completes it (it may start in their text); one that
ends in their text never matches. Those are the tokens a stop token id may be (scheduler/penalty_state.py
masks the ids before them).

Streaming sends no text that might still become a stop string: `StopMatcher` holds back the longest
suffix of the text so far that is a prefix of some stop string, releases it once it can no longer
match, and drops it at a match; so the streamed deltas add up to the non-streamed text.

`stop` takes at most MAX_STOP_STRINGS strings (OpenAI's limit); an empty string is refused (vLLM's
"stop cannot contain an empty string": it would match before the first token).
"""
from __future__ import annotations

from collections.abc import Sequence

from scheduler.tokenizer import IncrementalDecoder, completion_context

MAX_STOP_STRINGS = 4  # OpenAI: "Up to 4 sequences where the API will stop generating further tokens"


def check_stop_strings(stops: Sequence[str]) -> tuple[str, ...]:
    """The stop strings of a request, deduplicated; ValueError for an empty one, one that is no text (a lone
    surrogate, which JSON carries and UTF-8 cannot: no generated text holds it, as `bad_words` refuses it) or too
    many."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    if any(s == "" for s in stops):
        raise ValueError("'stop' cannot contain an empty string")
    for stop in stops:
        try:
            stop.encode("utf-8")
        except UnicodeError as exc:
            raise ValueError(f"the stop is not valid Unicode text: {exc}") from None
    return tuple(dict.fromkeys(stops))


class StopMatcher:
    """Text deltas in, text that may be sent out; `matched` is the stop string once one matched
    (nothing more may be fed then)."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        if not stops or any(not s for s in stops):
            raise ValueError("StopMatcher needs non-empty stop strings")
        self.stops, self.include_stop = tuple(stops), include_stop
        self._longest = max(map(len, self.stops))
        self._held = ""  # the text's suffix that is a prefix of a stop string: not sent yet
        self.matched: str | None = None

    def feed(self, delta: str, can_match: bool = True) -> str:
        """The text that can be sent after `delta` arrived. A match can only start in the held
        text or in `delta` (any earlier start would have been held), so only those are searched, for
        a match that `delta` completes: the held text may hold a whole stop string fed with
        can_match=False (min_tokens), which never matches."""
        if self.matched is not None:
            raise RuntimeError("a stop string already matched")
        text, held = self._held + delta, len(self._held)
        hits = [(i, s) for s in self.stops if can_match and (i := text.find(s, max(0, held - len(s) + 1))) >= 0]
        if hits:  # the leftmost; of those at one place, the first given (vLLM's order: its `stop_reason`)
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self._held = ""
            return text[:at + len(self.matched)] if self.include_stop else text[:at]
        keep = self._held_len(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The held text, at the end of a generation that matched nothing (it can match no more)."""
        held, self._held = self._held, ""
        return held

    def _held_len(self, text: str) -> int:
        for k in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[len(text) - k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class CompletionText:
    """One choice's text as its tokens arrive: incremental decoding after the prompt's context
    (`completion_context`; a chat passes none), then stop-string matching, from the token past the
    first `min_tokens` on (the text a token's feed returns is that token's). Without a tokenizer
    there is no text (token ids only; the API refuses stop strings then). include_stop: a matched stop
    string ends the text (vLLM's include_stop_str_in_output); skip_special_tokens, spaces_between_special_tokens:
    IncrementalDecoder's."""

    def __init__(self, tokenizer, context: Sequence[int], stops: Sequence[str] = (), min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.decoder = None
        if tokenizer is not None:
            self.decoder = IncrementalDecoder(tokenizer, completion_context(tokenizer, context), skip_special_tokens,
                                              spaces_between_special_tokens)
        self.matcher = StopMatcher(stops, include_stop) if stops and tokenizer is not None else None
        self.min_tokens, self.fed_tokens = min_tokens, 0

    @property
    def stopped(self) -> bool:
        """A stop string matched: the generation ends at the token just fed."""
        return self.matched is not None

    @property
    def matched(self) -> str | None:
        """The stop string that matched (vLLM's `stop_reason`), None while none has."""
        return None if self.matcher is None else self.matcher.matched

    def feed(self, token_id: int) -> str:
        if self.decoder is None or self.stopped:
            return ""
        delta = self.decoder.feed(token_id)
        self.fed_tokens += 1
        return delta if self.matcher is None else self.matcher.feed(delta, self.fed_tokens > self.min_tokens)

    def flush(self) -> str:
        """What is still held at the end of the generation (an incomplete character, text that
        might have begun a stop string); it may complete a match itself (`stopped` then)."""
        if self.decoder is None or self.stopped:
            return ""
        tail = self.decoder.flush()
        if self.matcher is None:
            return tail
        text = self.matcher.feed(tail, self.fed_tokens > self.min_tokens)  # (the last token's text)
        return text if self.stopped else text + self.matcher.flush()

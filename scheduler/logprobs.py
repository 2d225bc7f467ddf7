"""Token log-probabilities in the OpenAI API: the request fields that ask for them and the shapes they
are answered in (the engine's side: SamplingParams.logprobs, scheduler/sampling.py `token_logprobs`).

Asked for as OpenAI and vLLM take them (up to MAX_LOGPROBS alternatives):

* /v1/completions: `logprobs: k` (0..20): each generated token's logprob and the k likeliest tokens'
  (0: the sampled token's alone); false or null: none. With `echo`, the prompt's tokens' come first
  (SamplingParams.prompt_logprobs; scheduler/choices.py), the first one's logprob and top_logprobs null.
* /v1/chat/completions: `logprobs: true`, with `top_logprobs: k` (0..20; 0 when left out). A
  `top_logprobs` above 0 without `logprobs` is an 'unsupported_value' 400 (0 changes nothing).

Answered per choice, and per streamed chunk for that chunk's tokens (the chunks add up to the response):

* completions, OpenAI's legacy shape: {"tokens": [piece], "token_logprobs": [logprob],
  "top_logprobs": [{piece: logprob}], "text_offset": [characters of the pieces before it]}; a
  top_logprobs dict holds the k likeliest and the sampled token (k + 1 entries when it is not one of
  them; pieces that decode alike share one entry, as in vLLM).
* chat: {"content": [{"token": piece, "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}, the k likeliest in order.

A token's piece is its id decoded alone, or "token_id:N" (vLLM's form) where that decodes to nothing or
there is no tokenizer; `bytes` is the piece's UTF-8. A logprob below -9999 (-inf: no probability) is
-9999.0, as vLLM clamps it (JSON has no -inf).

vLLM's `return_tokens_as_token_ids: true` (either endpoint; nothing without logprobs): every piece is
"token_id:N", top_logprobs' too (a completion's text offsets then run on those pieces, as vLLM's do), so that
a client can tell tokens apart that decode alike or not at all. A chat entry's `bytes` are then vLLM's: the
token's decoded text's UTF-8, a special token's text kept whatever skip_special_tokens (null without a
tokenizer), each alternative's its "token_id:N"'s.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, StrictBool, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from scheduler.request import MAX_LOGPROBS, TokenLogprobs

LOWEST_LOGPROB = -9999.0

Count = Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]


class _TokenIdsField(BaseModel):
    return_tokens_as_token_ids: StrictBool | None = None  # vLLM's: pieces as "token_id:N" (LogprobsShaper)


class CompletionLogprobsField(_TokenIdsField):
    """/v1/completions' `logprobs` (mixed into api_models.CompletionRequest)."""
    logprobs: Count | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_off(cls, value):
        return None if value is False else value  # (`is`: 0 == False, and 0 asks for the sampled tokens')

    def logprob_count(self) -> int | None:
        return self.logprobs


class ChatLogprobsFields(_TokenIdsField):
    """/v1/chat/completions' `logprobs` and `top_logprobs` (mixed into api_models.ChatCompletionRequest)."""
    logprobs: StrictBool | None = None
    top_logprobs: Count | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError("unsupported_value", "'top_logprobs' is not supported without 'logprobs': true")
        return value

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class LogprobsShaper:
    """One choice's token logprobs in its endpoint's shape: `entry` per token as it arrives (in order:
    a completion's text offsets run on), `render` for a response's or a chunk's entries."""

    def __init__(self, tokenizer, chat: bool, skip_special_tokens: bool = True, as_token_ids: bool = False) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.skip_special_tokens = skip_special_tokens  # (as the choice's text: a special token's piece is its text)
        self.as_token_ids = as_token_ids  # return_tokens_as_token_ids
        self.offset_chars = 0  # a completion's text_offset: characters of the pieces so far

    def _decoded(self, token_id: int, skip_special_tokens: bool | None = None) -> str | None:
        skip = self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        return self.tokenizer.decode([token_id], skip_special_tokens=skip) if self.tokenizer is not None else None

    def piece(self, token_id: int) -> str:
        text = None if self.as_token_ids else self._decoded(token_id)
        return text or f"token_id:{token_id}"

    def entry(self, token_id: int, lp: TokenLogprobs | None):
        """lp None: an echoed prompt's first token (a completion's; nothing precedes it: no logprob)."""
        if self.chat:
            item = self._chat_item(token_id, lp.logprob)
            if self.as_token_ids:  # (vLLM's: the token's own bytes, its alternatives' their "token_id:N"'s)
                decoded = self._decoded(token_id, skip_special_tokens=False)  # (vLLM's decoded_token keeps them)
                item["bytes"] = None if decoded is None else list(decoded.encode("utf-8", errors="replace"))
            return {**item, "top_logprobs": [self._chat_item(t, v) for t, v in lp.top]}
        piece = self.piece(token_id)
        offset, self.offset_chars = self.offset_chars, self.offset_chars + len(piece)
        if lp is None:
            return piece, None, None, offset
        top: dict[str, float] = {}
        for t, v in [*lp.top, (token_id, lp.logprob)]:  # the sampled token's, where it is not one of the k
            top.setdefault(self.piece(t), finite(v))
        return piece, finite(lp.logprob), top, offset

    def follow_prompt(self, prompt_ids: list[int]) -> None:
        """An echoed completion's: its tokens' text offsets run on after its prompt's pieces (whose
        entries, `prompt_entries`, come first)."""
        self.offset_chars = sum(len(self.piece(t)) for t in prompt_ids)

    def prompt_entries(self, prompt_ids: list[int], lps: list[TokenLogprobs | None]) -> list:
        """An echoed prompt's entries, text offsets from 0 (Request.prompt_logprobs: the first None)."""
        shaper = LogprobsShaper(self.tokenizer, self.chat, self.skip_special_tokens, self.as_token_ids)
        return [shaper.entry(t, lp) for t, lp in zip(prompt_ids, lps)]

    def _chat_item(self, token_id: int, logprob: float) -> dict:
        piece = self.piece(token_id)
        return {"token": piece, "logprob": finite(logprob), "bytes": list(piece.encode("utf-8"))}

    def render(self, entries: list) -> dict:
        if self.chat:
            return {"content": list(entries)}
        tokens, values, tops, offsets = (list(col) for col in zip(*entries)) if entries else ([], [], [], [])
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def finite(logprob: float) -> float:
    return logprob if logprob >= LOWEST_LOGPROB else LOWEST_LOGPROB  # (NaN too: it fails the comparison)

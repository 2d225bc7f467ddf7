"""vLLM's extra fields `allowed_token_ids` and `bad_words` in the OpenAI API, on /v1/completions and
/v1/chat/completions, served as vLLM serves them (the engine's side: SamplingParams.allowed_token_ids and
bad_words_token_ids, scheduler/token_bans.py):

* allowed_token_ids: a non-empty list of token ids (each below the vocabulary size, at most 262,144 of them):
  only these may be sampled;
* bad_words: a list of strings, each tokenized by the server's tokenizer (without special tokens) as vLLM does:
  the word with its leading blanks stripped, and that with one leading space where it gives as many tokens
  with another first token (a word inside text); a one-token word is never sampled, a longer word's last
  token is not sampled where the answer's last tokens are the rest of it (the answer's, not the prompt's). At
  most 128 token sequences of 1,024 tokens in all (vLLM's cap on their number).

Left out or null (bad_words []): no restriction. A JSON type other than these (a bool for an id) is an
'invalid_type' 400; an empty list, an id outside the vocabulary, a word that tokenizes to nothing or too many
words an 'invalid_value' 400, each naming the field.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, StrictInt, StrictStr, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from scheduler.request import ALLOWED_TOKEN_IDS_MAX, BAD_WORDS_MAX, BAD_WORDS_MAX_TOKENS


class BanFields(BaseModel):
    """allowed_token_ids and bad_words (mixed into api_models' request models). The vocabulary's size comes in
    the validation context ({"vocab_size": V}, api_inputs.parse_prompts)."""
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed(cls, ids: list[int] | None, info: ValidationInfo) -> list[int] | None:
        # (the error types are the ones api_models.validation_error maps: less_than*, greater_than*: 'invalid_value')
        if ids is None:
            return None
        if not ids:
            raise PydanticCustomError("greater_than_equal", "at least one token id must be allowed (null: all)")
        if len(ids) > ALLOWED_TOKEN_IDS_MAX:
            raise PydanticCustomError("less_than_equal", "at most {most} token ids may be allowed, got {n}",
                                      {"most": ALLOWED_TOKEN_IDS_MAX, "n": len(ids)})
        vocab = (info.context or {}).get("vocab_size")
        for t in ids:
            if t < 0 or vocab is not None and t >= vocab:
                top = "" if vocab is None else f" below the vocabulary size {vocab}"
                raise PydanticCustomError("less_than", "{t} is not a token id of this model (an integer >= 0{top})",
                                          {"t": t, "top": top})
        return ids

    def ban_params(self, tokenizer, vocab_size: int) -> dict[str, Any]:
        """SamplingParams' allowed_token_ids and bad_words_token_ids (the words tokenized by `tokenizer`)."""
        return {"allowed_token_ids": None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
                "bad_words_token_ids": bad_words_token_ids(self.bad_words or [], tokenizer, vocab_size)}


def bad_words_token_ids(words: list[str], tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad words (SamplingParams.update_from_tokenizer): each word without its leading
    blanks, and " " + that where it tokenizes to as many tokens with another first one; APIError naming
    'bad_words' for a word that tokenizes to nothing, too many, or an id outside the vocabulary."""
    from scheduler.api_inputs import check_texts  # (api_inputs imports api_models, which imports this module)
    from scheduler.api_models import APIError

    def refuse(message: str) -> APIError:
        return APIError(400, message, param="bad_words", code="invalid_value")

    if not words:
        return ()
    check_texts(words, "bad_words")  # (a lone surrogate: UTF-8 cannot encode it, the tokenizer raised)
    if tokenizer is None:
        raise refuse("this model has no tokenizer, so bad words cannot be tokenized")
    out: list[tuple[int, ...]] = []
    for word in words:  # (each word gives a sequence or two: past the limits, the rest is not tokenized)
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise refuse(f"bad word {word!r} tokenizes to no token")
        out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):  # (vLLM's test)
            out.append(spaced)
        if len(out) > BAD_WORDS_MAX or sum(map(len, out)) > BAD_WORDS_MAX_TOKENS:
            raise refuse(f"at most {BAD_WORDS_MAX} bad words' token sequences of {BAD_WORDS_MAX_TOKENS} tokens in "
                         f"all are allowed (each word gives one, or two with its leading space); {len(words)} words "
                         f"give more")
    if bad := [t for w in out for t in w if not 0 <= t < vocab_size]:
        raise refuse(f"bad words tokenize to ids outside the vocabulary [0, {vocab_size}): {bad[:8]}")
    return tuple(out)

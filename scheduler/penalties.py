"""Penalties, logit_bias and min_tokens in the OpenAI API: OpenAI's `presence_penalty` and `frequency_penalty`
([-2, 2]), vLLM's extra `repetition_penalty` ((0, 10]; 1: off), OpenAI's `logit_bias` and vLLM's extra
`min_tokens`, on /v1/completions and /v1/chat/completions, served as vLLM serves them (the engine's side:
SamplingParams' fields of these names, scheduler/penalty_state.py `apply_penalties`):

* logit_bias: a JSON object of token ids (as strings: {"50256": -100}) to a bias in [-100, 100], at most
  1,024 of them, each added to its token's logit first (-100 bans a token in practice, 100 forces it);
* repetition: over the prompt's tokens and the generated ones, a positive logit divided by it,
  another multiplied;
* presence and frequency: over the tokens this choice generated so far, a token's logit less
  frequency_penalty * its count + presence_penalty * (count > 0);

* min_tokens: an integer in [0, max_tokens] (max_tokens left out: its default, within the limit): the
  stop token ids and EOS (with ignore_eos too, as vLLM's) at -inf while fewer tokens were generated, and no stop
  string matched before (scheduler/stop_strings.py);

on the logits before temperature and top-p (and before greedy's argmax); logprobs stay those of the
raw logits. Left out or null (or {}): the neutral value. A JSON string or bool (for min_tokens, any
non-integer) is an 'invalid_type' 400, a value outside the range (a token id outside the vocabulary)
an 'invalid_value' 400, each naming the field; a logit_bias key that is not an integer is an
'invalid_type' 400.
"""
from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from scheduler.request import LOGIT_BIAS_MAX, LOGIT_BIAS_MAX_TOKENS, PRESENCE_FREQUENCY_MAX, REPETITION_MAX

Penalty = Annotated[float, Field(strict=True, ge=-PRESENCE_FREQUENCY_MAX, le=PRESENCE_FREQUENCY_MAX)]
Repetition = Annotated[float, Field(strict=True, gt=0.0, le=REPETITION_MAX)]
Bias = Annotated[float, Field(strict=True, ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]
_INTEGER = re.compile(r"-?[0-9]+")


class PenaltyFields(BaseModel):
    """The penalty and logit_bias fields of both endpoints (mixed into api_models' request models). The
    vocabulary's size comes in the validation context ({"vocab_size": V}, api_inputs.parse_prompts)."""
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Repetition | None = None  # (vLLM's extra field)
    logit_bias: dict[str, Bias] | None = None  # (LangChain's OpenAI LLM sends {} by default)
    min_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None  # (vLLM's extra field; <= max_tokens:
                                                                         # `penalty_params`)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None, info: ValidationInfo) -> dict[str, float] | None:
        # (the error types are the ones api_models.validation_error maps: less_than*: 'invalid_value')
        if bias is not None and len(bias) > LOGIT_BIAS_MAX_TOKENS:
            raise PydanticCustomError("less_than_equal", "at most {most} token ids may be biased, got {n}",
                                      {"most": LOGIT_BIAS_MAX_TOKENS, "n": len(bias)})
        vocab = (info.context or {}).get("vocab_size")
        # (pydantic fills "{key}" from the context, not "{key!r}": the key goes in quoted; regression:
        # the errors showed a literal "{key!r}")
        for key in bias or ():
            if not _INTEGER.fullmatch(key):
                raise PydanticCustomError("int_parsing", "a key must be a token id as an integer string "
                                          "(such as \"50256\"), got {key}", {"key": repr(key)})
            # (no leading zeros: "05" and "5" would name one token twice; a long one is not a token id)
            if key.startswith(("-", "0")) and key != "0" or len(key) > 12 or vocab is not None and int(key) >= vocab:
                top = "" if vocab is None else f" below the vocabulary size {vocab}"
                raise PydanticCustomError("less_than", "key {key} is not a token id of this model (an integer "
                                          ">= 0{top}, without leading zeros)", {"key": repr(key), "top": top})
        return bias

    def penalty_params(self, max_tokens: int) -> dict[str, Any]:
        """SamplingParams' penalty, logit_bias and min_tokens fields, a field left out at its neutral value.
        max_tokens: the request's, its default where left out (unknown to the fields' validators)."""
        min_tokens = self.min_tokens or 0
        if min_tokens > max_tokens:
            from scheduler.api_models import APIError  # (api_models imports this module)
            raise APIError(400, f"'min_tokens' must be in [0, max_tokens = {max_tokens}], got {min_tokens}",
                           param="min_tokens", code="invalid_value")
        return {"presence_penalty": float(self.presence_penalty or 0.0),
                "frequency_penalty": float(self.frequency_penalty or 0.0),
                "repetition_penalty": 1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
                "logit_bias": {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
                "min_tokens": min_tokens}

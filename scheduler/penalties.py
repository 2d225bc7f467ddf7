"""Penalties in the OpenAI API: OpenAI's `presence_penalty` and `frequency_penalty` ([-2, 2]) and vLLM's
extra `repetition_penalty` ((0, 10]; 1: off), on /v1/completions and /v1/chat/completions, served as
vLLM serves them (the engine's side: SamplingParams' fields of these names, scheduler/sampling.py
`apply_penalties`):

* presence and frequency: over the tokens this choice generated so far, a token's logit less
  frequency_penalty * its count + presence_penalty * (count > 0);
* repetition: over the prompt's tokens and the generated ones, a positive logit divided by it,
  another multiplied;

on the logits before temperature and top-p (and before greedy's argmax); logprobs stay those of the
raw logits. Left out or null: the neutral value. A JSON string or bool is an 'invalid_type' 400, a
value outside the range an 'invalid_value' 400, each naming the field.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from scheduler.request import PRESENCE_FREQUENCY_MAX, REPETITION_MAX

Penalty = Annotated[float, Field(strict=True, ge=-PRESENCE_FREQUENCY_MAX, le=PRESENCE_FREQUENCY_MAX)]
Repetition = Annotated[float, Field(strict=True, gt=0.0, le=REPETITION_MAX)]


class PenaltyFields(BaseModel):
    """The penalty fields of both endpoints (mixed into api_models' request models)."""
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Repetition | None = None  # (vLLM's extra field)

    def penalty_params(self) -> dict[str, float]:
        """SamplingParams' penalty fields, a field left out at its neutral value."""
        return {"presence_penalty": float(self.presence_penalty or 0.0),
                "frequency_penalty": float(self.frequency_penalty or 0.0),
                "repetition_penalty": 1.0 if self.repetition_penalty is None else float(self.repetition_penalty)}

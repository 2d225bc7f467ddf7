"""vLLM's extra sampling fields in the OpenAI API, on /v1/completions and /v1/chat/completions, served as
vLLM serves them (the engine's side: SamplingParams' fields of these names, scheduler/sampling.py `sample`):

* top_k: an integer >= -1: only the k likeliest tokens are drawn from (ties with the k-th kept); 0 or -1
  (or a k at least the vocabulary's size): all of them;
* min_p: a number in [0, 1]: only the tokens at least min_p times as likely as the likeliest are drawn
  from; 0: all of them;

after temperature (min_p, then top-k, then top-p, as vLLM V1); a greedy request (temperature 0) ignores
both. Left out or null: all tokens. A JSON string or bool (for top_k, any non-integer) is an
'invalid_type' 400, a value outside the range an 'invalid_value' 400, each naming the field.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field


class SamplerFields(BaseModel):
    """top_k and min_p (mixed into api_models' request models)."""
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None
    min_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None

    def sampler_params(self) -> dict[str, Any]:
        """SamplingParams' top_k and min_p, a field left out at its neutral value."""
        return {"top_k": self.top_k or 0, "min_p": float(self.min_p or 0.0)}

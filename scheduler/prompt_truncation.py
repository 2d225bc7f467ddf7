"""vLLM's `truncate_prompt_tokens` (completions and chat; mixed into api_models' request models, applied by
api_inputs.parse_prompts to each prompt's token ids, a chat's after its template):

* k >= 1: the prompt's last k tokens are kept (vLLM's default truncation side, "left"); a prompt of k tokens
  or fewer is kept whole. usage.prompt_tokens counts the kept tokens, and a completion's `echo` shows them.
* -1: the longest prompt the request can have: within --max-prompt-tokens, and within the tokens of K/V a
  request can hold less its max_tokens - 1 (vLLM's max_model_len - max_tokens), so a long prompt is served; a beam
  search's within --max-prompt-tokens less max_tokens - 1 too (its steps send each beam as a prompt).
* k past that longest prompt: a 400 naming the field, whatever the prompt's length (vLLM's); 0, below -1, or
  not an integer: a 400 naming it (vLLM takes 0 as an empty prompt, which no engine serves).

The longest prompt reads the request's max tokens (max_completion_tokens before max_tokens); one left out
counts as a completion's default and as none for a chat (which then gets the rest of its context), as vLLM
counts it.
"""
from __future__ import annotations

from pydantic import BaseModel, StrictInt

PARAM = "truncate_prompt_tokens"  # (the 400's param: api_inputs turns a ValueError here into it)


class TruncationField(BaseModel):
    """The request field (mixed into api_models._SamplingFields)."""
    truncate_prompt_tokens: StrictInt | None = None


def kept_tokens(req, chat: bool, *, prompt_limit: int, context_tokens: int | None, default_max_tokens: int,
                max_tokens_limit: int) -> int | None:
    """How many of each prompt's last tokens the request keeps (None: all); ValueError for a value it refuses.
    `prompt_limit`: the longest prompt the server takes; `context_tokens`: the tokens of K/V one request can
    hold (None: unknown, unbounded)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return None
    if k != -1 and k < 1:
        raise ValueError(f"'{PARAM}' must be -1 (the longest prompt the request can have) or >= 1, got {k}")
    longest = _longest_prompt(req, chat, prompt_limit, context_tokens, default_max_tokens, max_tokens_limit)
    if longest < 1:  # max_tokens alone fills the context: its own 400 follows (it names max_tokens)
        return max(k, 1)
    if k == -1:
        return longest
    if k > longest:
        # the limit field the request used (regression: a chat of max_completion_tokens was told its max_tokens)
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        within = "" if context_tokens is None else f", and the {context_tokens} tokens a request can hold less " \
                                                   f"its {field} - 1"
        # (a beam search's limit is less its max_tokens - 1 too: regression, the 400 named limits that gave not the
        # longest prompt it reported)
        beam = f" less its {field} - 1 (a beam search sends each beam as a prompt)" \
            if getattr(req, "use_beam_search", False) else ""
        raise ValueError(f"'{PARAM}' of {k} exceeds the longest prompt this request can have, {longest} tokens "
                         f"(--max-prompt-tokens{beam}{within})")
    return k


def _longest_prompt(req, chat: bool, prompt_limit: int, context_tokens: int | None, default_max_tokens: int,
                    max_tokens_limit: int) -> int:
    max_tokens = getattr(req, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = 0 if chat else min(default_max_tokens, max_tokens_limit)
    max_tokens = min(max(max_tokens, 0), max_tokens_limit)  # (an out-of-range one: its own 400 follows)
    if getattr(req, "use_beam_search", False):  # each step re-sends a beam as a prompt: prompt + max_tokens - 1
        # within the prompt limit (scheduler/api_beam_search.py; regression: -1 kept the whole limit, then a 400)
        prompt_limit -= max(max_tokens - 1, 0)
    if context_tokens is None:
        return prompt_limit
    return min(prompt_limit, context_tokens - max(max_tokens - 1, 0))  # (scheduler/request.py's kv_tokens)

"""vLLM's `prompt_logprobs: k` on /v1/completions and /v1/chat/completions: each prompt token's logprob given
the tokens before it, and the k likeliest tokens' at its position (the engine's SamplingParams.prompt_logprobs:
the prompt is computed whole, taking no cached prefix; scheduler/runner.py).

Asked for as vLLM takes it: an integer in [0, MAX_LOGPROBS] (vLLM's --max-logprobs default), or -1 for the
whole vocabulary, which is refused here as vLLM refuses it at its default cap (any vocabulary past MAX_LOGPROBS
tokens); streamed, k > 0 or -1 is a 400 (vLLM's: a stream never carries them) and 0 asks nothing. Every refusal
is a 400 naming `prompt_logprobs`. A completion with `echo` and `logprobs` too: the engine computes the larger k
and each shape shows its own (scheduler/choices.py).

Answered as vLLM answers it (its Logprob objects, `clamp_prompt_logprobs`): a list with one item per prompt
token, null for the first (nothing precedes it), then a dict keyed by token id: the prompt's own token first,
then the k likeliest in order (the own token once, where it is one of them), each
{"logprob": float (-inf as -9999.0), "rank": int (1: the likeliest; the k likeliest by position, the own token
otherwise by the count of tokens at least as likely), "decoded_token": the id decoded alone, special tokens
kept (null without a tokenizer)}. A completion's every choice carries its prompt's (its prompt's first choice's
list: one prompt, one answer); a chat's sits at the response's top level, beside `choices`.
"""
from __future__ import annotations

from pydantic import BaseModel, StrictInt

from scheduler.logprobs import finite
from scheduler.request import MAX_LOGPROBS, TokenLogprobs

PARAM = "prompt_logprobs"


class PromptLogprobsField(BaseModel):
    """The request field (mixed into api_models._SamplingFields: both endpoints)."""
    prompt_logprobs: StrictInt | None = None


def asked_count(req, vocab_size: int) -> int | None:
    """The k a request's `prompt_logprobs` asks the engine for (None: none; a stream's 0 shows nothing, so it
    asks nothing); ValueError with the 400's message for a value it refuses (api_inputs names the field)."""
    k = getattr(req, PARAM, None)
    if k is None:
        return None
    if req.stream and (k > 0 or k == -1):
        raise ValueError(f"'{PARAM}' is not available when 'stream' is true (vLLM's); send 0 or leave it out")
    if k < -1:
        raise ValueError(f"'{PARAM}' must be >= 0, or -1 for the whole vocabulary, got {k}")
    count = vocab_size if k == -1 else k
    if count > MAX_LOGPROBS:
        whole = f" (-1: the whole vocabulary of {vocab_size} tokens)" if k == -1 else ""
        raise ValueError(f"'{PARAM}' of {count}{whole} exceeds the most allowed, {MAX_LOGPROBS}")
    return None if req.stream else count


MAX_RESPONSE_ENTRIES = 1 << 21  # prompt logprob entries one request may ask for, n times each prompt's (the engine
# keeps each choice's; ~70 bytes of JSON each; scoring a million prompt tokens, echo and logprobs 1, fits)


def check_fan_out(req, prompt_tokens: list[int], vocab_size: int) -> None:
    """APIError (400) where the prompts' logprob entries a request asks for, `prompt_logprobs` and an echo's, for
    every choice, pass MAX_RESPONSE_ENTRIES (regression: four prompts of 4,000 tokens, n=16, prompt_logprobs 20: a
    378 MB body, 2 GB of memory and the loop held 17-28 s; n and a batch multiply what one prompt asks). A chat's
    response shows its prompt's once, but the engine keeps each choice's, so n counts there too (regression: the
    message said "one response carries" them)."""
    from scheduler.api_models import APIError  # (api_models imports this module's fields)
    shown = shown_count(req, vocab_size)
    echoed = req.logprob_count() if getattr(req, "echo", False) else None
    per_token = (0 if shown is None else shown + 1) + (0 if echoed is None else echoed + 1)
    entries = per_token * sum(prompt_tokens) * (req.n or 1)
    if entries > MAX_RESPONSE_ENTRIES:
        param = PARAM if shown is not None else "logprobs"
        raise APIError(400, f"the prompts' logprobs would be {entries:,} entries ({sum(prompt_tokens):,} prompt "
                            f"tokens x {per_token} x n={req.n or 1}), past the {MAX_RESPONSE_ENTRIES:,} one request "
                            f"may ask for: ask fewer (a smaller k, n or batch)", param=param, code="invalid_value")


def shown_count(req, vocab_size: int) -> int | None:
    """The k a response shows of each position (None: it carries no `prompt_logprobs`; a stream never does);
    for a request `asked_count` took."""
    k = getattr(req, PARAM, None)
    if k is None or req.stream:
        return None
    return vocab_size if k == -1 else k


def render(prompt_ids: list[int], lps: list[TokenLogprobs | None], k: int, tokenizer) -> list[dict | None]:
    """A prompt's entries (Request.prompt_logprobs, the first None; each `top` the engine's k, at least `k`) in
    vLLM's shape, its k likeliest of each position. Keys are strings: JSON's (vLLM's ints become them too)."""
    decoded: dict[int, str | None] = {}

    def item(token_id: int, logprob: float, rank: int | None) -> dict:
        if token_id not in decoded:  # (a prompt's tokens and the likeliest repeat across positions)
            decoded[token_id] = None if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False)
        return {"logprob": finite(logprob), "rank": rank, "decoded_token": decoded[token_id]}

    out: list[dict | None] = []
    for token_id, lp in zip(prompt_ids, lps):
        if lp is None:
            out.append(None)
            continue
        entries = {str(token_id): item(token_id, lp.logprob, lp.rank)}
        for rank, (t, v) in enumerate(lp.top[:k], 1):  # (the own token, one of them: its position's rank, as vLLM's)
            entries[str(t)] = item(t, v, rank)
        out.append(entries)
    return out


def shorter(lps: list[TokenLogprobs | None], k: int) -> list[TokenLogprobs | None]:
    """The entries with their k likeliest only (an echo's, where prompt_logprobs asked the engine for more)."""
    return [lp if lp is None or len(lp.top) <= k else lp._replace(top=lp.top[:k]) for lp in lps]

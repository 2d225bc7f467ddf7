"""vLLM's beam search (its `use_beam_search`, vllm/engine/protocol.py `EngineClient.beam_search` as vLLM V1 runs it),
over the engine's async API: one step at a time, each live beam a one-token engine request (max_tokens 1, logprobs
2 * beam_width) whose prompt is the beam's whole sequence, all of a step's beams in flight together. The prefix cache
makes each step's re-prefill cheap: a beam's sequence is its parent's plus one token, so all but its last, partial
page is a hit (`BeamSearchResult.cached_tokens_per_step`). The HTTP API serves it in scheduler/api_beam_search.py.

    result = await beam_search(engine, prompt_ids, BeamSearchParams(beam_width=4, max_tokens=32))
    result.beams[0].output_ids, result.beams[0].finish_reason      # best first

The algorithm is vLLM's: beams start as [prompt]; at each of max_tokens steps each beam's candidates are its step's
sampled token and its 2 * beam_width likeliest (raw logprobs, the model's: before temperature); a candidate that is an
end token goes to `completed` (the token kept in its tokens only with include_stop_str_in_output), any other grows a
beam (cum_logprob + its logprob); the best beam_width grown beams by score live on. At the end completed and live
beams are sorted by score and the best beam_width returned ("stop" for an ended beam, else "length"). Score:
cum_logprob / seq_len ** length_penalty, seq_len the whole sequence's tokens (prompt included), less the end token
where the beam keeps it (vLLM's get_beam_search_score; vLLM also takes one off a beam whose last token is the EOS
under ignore_eos, where it ends nothing: here that token counts, as the beam's other tokens).

Beyond vLLM's, cheap to honour here: the end tokens are the model's EOS ids (unless ignore_eos) and stop_token_ids
(vLLM: the tokenizer's eos_token only, stop_token_ids ignored); min_tokens keeps end tokens from ending a beam before
that many tokens (vLLM ignores it): they are passed over as if masked, a beam's candidates then its likeliest others
(its step asks as many more logprobs, within MAX_LOGPROBS, and its sampled token is masked from them); top_p, top_k,
min_p and seed shape each step's sampled token, and priority, cache_salt and prompt_logprobs (its first step's) go to
the step requests. temperature defaults to 0 (vLLM's BeamSearchParams; scheduler/api_beam_search.py says where vLLM's
server differs).

Errors: a step that fails or is aborted ends the search with `BeamSearchError` (its finish_reason "error" or
"abort"), its other steps aborted; cancelling the search aborts the steps in flight. Nothing is left in the engine.
A search under way is counted in `Engine.continuing`: a shutdown's grace waits for it and takes its steps after the
first, as it lets a running request finish."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import anyio
from pydantic import BaseModel, Field, StrictBool

from scheduler.request import MAX_LOGPROBS, Request, RequestError, SamplingParams, _is_integer, _is_real

if TYPE_CHECKING:
    from scheduler.engine import Engine

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step asks 2 * beam_width logprobs, at most the engine's MAX_LOGPROBS
LENGTH_PENALTY_MAX = 10.0  # |length_penalty|: seq_len ** it stays a finite float for any context (vLLM: unbounded)


class BeamSearchFields(BaseModel):
    """vLLM's request fields (mixed into api_models._SamplingFields; served by scheduler/api_beam_search.py):
    `n` is then the beam width. length_penalty without use_beam_search is accepted and ignored, as vLLM's."""
    use_beam_search: StrictBool = False
    length_penalty: Annotated[float, Field(strict=True)] = 1.0


class BeamSearchError(RuntimeError):
    """A step request failed ("error") or was aborted ("abort"); the search ended with it."""

    def __init__(self, message: str, finish_reason: str) -> None:
        super().__init__(message)
        self.finish_reason = finish_reason


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int = 1  # the API's `n`: beams kept at each step, and returned
    max_tokens: int = 16  # steps
    temperature: float = 0.0
    length_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # an ended beam keeps its end token
    # beyond vLLM's (module docstring)
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: int | None = None

    def step_params(self, first: bool, held: frozenset[int] = frozenset()) -> SamplingParams:
        """A step request's: one token and its 2 * beam_width likeliest (the first step's, the prompt's logprobs).
        While min_tokens holds the end tokens (`held`) back, len(held) more likeliest, which are passed over
        (`_candidates`), and the sampled token is never one: the step's own min_tokens masks them on the device, as a
        plain request's (regression: where the held ends filled the MAX_LOGPROBS likeliest and the step sampled one,
        a beam had no candidate, and a search of one beam returned none)."""
        logprobs = min(2 * self.beam_width + len(held), MAX_LOGPROBS)
        masked = dict(min_tokens=1, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos) if held else {}
        return SamplingParams(max_tokens=1, logprobs=logprobs, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
                              priority=self.priority, cache_salt=self.cache_salt,
                              prompt_logprobs=self.prompt_logprobs if first else None, **masked)

    def validate(self, engine: "Engine", prompt: list[int], prompt_limit: int | None = None) -> None:
        """RequestError naming the field: the engine's checks of the whole search (its fields' ranges, prompt +
        max_tokens - 1 tokens of K/V), and every step's prompt within the engine's prompt limit (or a lower one: a
        server's --max-prompt-tokens)."""
        if not _is_integer(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise RequestError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}] (each step asks 2 * beam_width "
                               f"logprobs, at most {MAX_LOGPROBS}), got {self.beam_width!r}", "beam_width")
        if not _is_real(self.length_penalty) or not abs(self.length_penalty) <= LENGTH_PENALTY_MAX:  # (NaN fails)
            raise RequestError(f"length_penalty must be a number in [-{LENGTH_PENALTY_MAX:g}, {LENGTH_PENALTY_MAX:g}], "
                               f"got {self.length_penalty!r}", "length_penalty")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise RequestError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}",
                               "include_stop_str_in_output")
        if not _is_integer(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        whole = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop_token_ids=self.stop_token_ids,
                               ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=2 * self.beam_width,
                               prompt_logprobs=self.prompt_logprobs, priority=self.priority,
                               cache_salt=self.cache_salt)
        engine.validate(prompt, whole)
        limit = engine.max_prompt_tokens if prompt_limit is None else min(prompt_limit, engine.max_prompt_tokens)
        last = len(prompt) + self.max_tokens - 1  # (the last step's prompt: the prompt and all but one new token)
        if last > limit:
            raise RequestError(f"beam search re-sends each beam as a prompt: prompt ({len(prompt)}) + max_tokens "
                               f"({self.max_tokens}) - 1 = {last} tokens exceeds the prompt limit of {limit}",
                               "max_tokens")


@dataclass
class Beam:
    """A sequence of the search: its tokens include the prompt (vLLM's BeamSearchSequence)."""
    tokens: list[int]
    cum_logprob: float
    prompt_tokens: int
    end_token: int | None = None  # the end token (EOS or a stop id) that ended it; None: it ran to max_tokens
    kept_end: bool = False  # its tokens end with end_token (include_stop_str_in_output)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_tokens:]

    @property
    def finish_reason(self) -> str:
        return "length" if self.end_token is None else "stop"

    def score(self, length_penalty: float) -> float:
        return score(self.cum_logprob, len(self.tokens) - self.kept_end, length_penalty)


def score(cum_logprob: float, seq_len: int, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: seq_len counts the prompt, not an end token the beam keeps."""
    return cum_logprob / (seq_len ** length_penalty)


@dataclass
class BeamSearchResult:
    beams: list[Beam]  # the best beam_width (fewer only where end tokens left too few candidates), best first
    hit_tokens: dict[str, int]  # the prompt's prefix-cache hit per tier (the first step's)
    prompt_logprobs: list | None = None  # the first step's, where asked (Request.prompt_logprobs' shape)
    cached_tokens_per_step: list[int] = field(default_factory=list)  # per step, the fewest any beam read cached


async def beam_search(engine: "Engine", prompt: list[int], params: BeamSearchParams,
                      rid: str | None = None) -> BeamSearchResult:
    """The search (module docstring); step requests are named `{rid}-beam{step}.{beam}`. Raises RequestError
    for bad params (nothing queued), BeamSearchError when a step fails."""
    prompt = list(prompt)
    params.validate(engine, prompt)
    await engine.start()
    base = rid or f"beam-{uuid.uuid4().hex[:12]}"
    ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(engine.model_config.eos_token_ids))
    width, n_prompt = params.beam_width, len(prompt)
    live, completed = [Beam(prompt, 0.0, n_prompt)], []
    result = BeamSearchResult([], {})
    engine.continuing += 1  # (a shutdown's grace waits for the search and takes its steps after the first)
    try:
        for step in range(params.max_tokens):
            held = ends if step < params.min_tokens else set()  # (end tokens min_tokens holds back: passed over)
            step_params = params.step_params(first=step == 0, held=frozenset(held))
            reqs = await _all([_step(engine, beam.tokens, step_params, f"{base}-beam{step}.{i}", step > 0)
                               for i, beam in enumerate(live)])
            result.cached_tokens_per_step.append(min(sum(r.hit_tokens.values()) for r in reqs))
            if step == 0:
                result.hit_tokens = dict(reqs[0].hit_tokens)
                result.prompt_logprobs = list(reqs[0].prompt_logprobs) if params.prompt_logprobs is not None else None
            live = _rank(live, reqs, params, ends, held, n_prompt + step + 1, completed)
            if not live:
                break
    finally:
        engine.continuing -= 1
    result.beams = sorted(completed + live, key=lambda b: b.score(params.length_penalty), reverse=True)[:width]
    return result


def _rank(live: list[Beam], reqs: list[Request], params: BeamSearchParams, ends: set[int], held: set[int],
          seq_len: int, completed: list[Beam]) -> list[Beam]:
    """One step: each live beam's candidates (its step request's) grow it, or complete it where they are end
    tokens (appended to `completed`); the best beam_width grown beams, every one `seq_len` tokens long, live on
    (ranked by score as vLLM ranks them, stable on ties)."""
    grown: list[tuple[Beam, int, float]] = []  # (parent, token, cum logprob): lists made for the kept only
    for beam, req in zip(live, reqs):
        for token, logprob in _candidates(req, 2 * params.beam_width, held):
            cum = beam.cum_logprob + logprob
            if token not in ends:
                grown.append((beam, token, cum))
            else:
                keep = params.include_stop_str_in_output
                completed.append(Beam(beam.tokens + [token] if keep else list(beam.tokens), cum, beam.prompt_tokens,
                                      end_token=token, kept_end=keep))
    grown.sort(key=lambda g: score(g[2], seq_len, params.length_penalty), reverse=True)
    kept = grown[:params.beam_width]
    return [Beam(parent.tokens + [token], cum, parent.prompt_tokens) for parent, token, cum in kept]


def _candidates(req: Request, count: int, held: set[int]) -> list[tuple[int, float]]:
    """A step's (token, logprob): the sampled token, then the `count` likeliest (vLLM V1's logprobs dict, in its
    order), the `held` tokens passed over, as if masked (regression: min_tokens dropped the end tokens among the
    likeliest, so a beam of n=1 whose two likeliest tokens were end tokens ended the search with no beam at all)."""
    token, lp = req.output[0], req.output_logprobs[0]
    top = [(t, v) for t, v in lp.top if t not in held][:count]
    sampled = [] if token in held else [(token, lp.logprob)]
    return sampled + [(t, v) for t, v in top if t != token]


async def _step(engine: "Engine", tokens: list[int], params: SamplingParams, rid: str,
                continuing: bool = False) -> Request:
    """One step request run to its end (aborted if the caller is cancelled first); continuing: a step after the
    first, which a shutdown's grace still takes (Engine.continuing)."""
    try:
        req = engine.add_request(tokens, params, rid, continuing=continuing)
    except RequestError as exc:  # (validated before: the engine is shutting down, or its loop crashed)
        raise BeamSearchError(f"a beam search step was refused: {exc}",
                              "error" if engine.accepting else "abort") from None
    try:
        while not (ev := await req.queue.get()).finished:
            pass
    finally:
        if not req.state.done:
            with anyio.CancelScope(shield=True):
                await engine.abort(req.rid)
    if ev.finish_reason not in ("length", "stop") or not req.output_logprobs:
        if ev.finish_reason == "abort":
            # (a client gone or a caller's cancel cancels the search, not this: a shutdown, or an abort of the step's
            # own request; regression: the latter said "the server is shutting down or the client went away")
            why = "the engine is shutting down" if not engine.accepting else f"its request {req.rid} was aborted"
            raise BeamSearchError(f"a beam search step was aborted ({why})", "abort")
        raise BeamSearchError(ev.error or f"a beam search step ended with {ev.finish_reason!r}", "error")
    return req


async def _all(steps: list) -> list[Request]:
    """The steps run together (asyncio.gather, as vLLM's); the first failure, or a cancellation, cancels the
    others (their requests aborted) before it is raised."""
    tasks = [asyncio.ensure_future(s) for s in steps]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)

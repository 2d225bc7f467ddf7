"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions (scheduler/server.py; the search itself:
scheduler/beam_search.py): `n` is the beam width (at most MAX_BEAM_WIDTH), `length_penalty` its score's exponent.
Each prompt gets one search, its n best beams the prompt's n choices, rendered by the same code as any choice
(a `Generation` whose token events are its beam's tokens: text after the prompt's, a chat's reasoning split and
tool calls, usage, stop_reason; scheduler/choices.py). As vLLM's beam search yields once, at its end, a stream
sends each beam's whole text in one chunk, then its finish chunk. Usage: the prompt's tokens once, every returned
beam's tokens (vLLM's). Each beam holds one of --max-concurrent-requests, as a choice does (a step has n requests
in flight). A client that goes away cancels the search (its steps in flight aborted); a step that fails fails the
request (500; 503 where it was aborted: a step queued after the server began shutting down is refused).

Fields a beam search cannot honour are a 400 naming them (vLLM ignores them silently): token `logprobs` (the
search returns none), stop strings (not matched on beams), penalties, logit_bias, allowed_token_ids, bad_words and
structured outputs (a "required" or named tool_choice too: beams are ranked by the model's raw logprobs, which none
of them changes). A field at its neutral value is fine (presence_penalty 0, logit_bias {}); the server's
--generation-config defaults are not applied to a search. stop_token_ids and the stop ids of `stop`, min_tokens,
ignore_eos, include_stop_str_in_output, echo, prompt_logprobs, seed, priority, cache_salt are honoured
(include_stop_str_in_output: an EOS-ended beam's text ends with the EOS's, as any choice's; vLLM's beam search
leaves the EOS out of the text, not of the token ids: the two differ where the EOS decodes to text).
temperature left out is 0, BeamSearchParams' default and vLLM's in process (vLLM's server takes the generation
config's or 1.0, so each beam's sampled candidate is random; here a search left at its default is deterministic).
max_tokens left out is the request's default (a chat's: the rest of the context, vLLM's), within what a step's prompt
may hold (prompt + max_tokens - 1 tokens).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time

from scheduler.api_models import APIError
from scheduler.beam_search import MAX_BEAM_WIDTH, BeamSearchError, BeamSearchParams, BeamSearchResult, beam_search
from scheduler.generation import Generation
from scheduler.request import MAX_LOGPROBS, Request, SamplingParams, TokenEvent

_RANKS = "beams are ranked by the model's raw logprobs"
_ABORTED = "the beam search was aborted (the server is shutting down or the client went away)"


def _unserved(api_req, params: SamplingParams):
    """(field, why) of each field the request sets that a beam search cannot honour."""
    if api_req.logprob_count() is not None:
        yield "logprobs", "a beam search returns no token logprobs"
    if api_req.stop_strings():
        yield "stop", "stop strings are not matched on beams (stop token ids are)"
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(api_req, name) not in (None, neutral):
            yield name, _RANKS
    for name in ("logit_bias", "allowed_token_ids", "bad_words"):
        if getattr(api_req, name):
            yield name, _RANKS
    if params.guided is not None:
        yield api_req.guided()[0], _RANKS


class BeamSearches:
    """The beam searches of one API request (one per prompt), each rendered as its prompt's n choices."""

    def __init__(self, st, api_req, params: SamplingParams, chat: bool, arrival: float) -> None:
        self.st, self.api_req, self.params, self.chat, self.arrival = st, api_req, params, chat, arrival
        self.n = api_req.n or 1
        self.search_params = BeamSearchParams(
            beam_width=self.n, max_tokens=params.max_tokens,
            temperature=0.0 if api_req.temperature is None else api_req.temperature,
            length_penalty=api_req.length_penalty, ignore_eos=params.ignore_eos,
            include_stop_str_in_output=api_req.include_stop_str_in_output, stop_token_ids=params.stop_token_ids,
            min_tokens=params.min_tokens, top_p=1.0 if api_req.top_p is None else api_req.top_p,
            top_k=api_req.top_k or 0, min_p=api_req.min_p or 0.0, seed=params.seed, priority=params.priority,
            cache_salt=params.cache_salt, prompt_logprobs=params.prompt_logprobs)

    @classmethod
    def of(cls, st, api_req, params: SamplingParams, chat: bool, arrival: float) -> "BeamSearches | None":
        """The request's searches where it asks for use_beam_search (None otherwise); APIError (400) naming a
        field it cannot honour."""
        if not api_req.use_beam_search:
            return None
        if (api_req.n or 1) > MAX_BEAM_WIDTH:
            raise APIError(400, f"'n' is the beam width with 'use_beam_search': at most {MAX_BEAM_WIDTH} (each step "
                                f"asks 2 * n logprobs, at most {MAX_LOGPROBS}), got {api_req.n}", param="n",
                           code="invalid_value")
        for name, why in _unserved(api_req, params):
            raise APIError(400, f"'{name}' cannot be used with 'use_beam_search' ({why})", param=name,
                           code="unsupported_value")
        return cls(st, api_req, params, chat, arrival)

    def _search_params(self, prompt: list[int]) -> BeamSearchParams:
        """The search's of `prompt`: a max_tokens the request left out (a chat's: the rest of the context) within
        what its last step's prompt may hold (regression: under --max-prompt-tokens a chat without max_tokens was
        always a 400 naming max_tokens, which it never sent)."""
        given = self.api_req.max_tokens is not None or getattr(self.api_req, "max_completion_tokens", None) is not None
        fits = self.st.prompt_limit + 1 - len(prompt)  # (prompt + max_tokens - 1 tokens at the last step)
        if given or self.search_params.max_tokens <= fits:
            return self.search_params
        return dataclasses.replace(self.search_params, max_tokens=max(fits, 1))

    def validate(self, prompt: list[int], _params: SamplingParams) -> None:
        """Engine.validate's part for a search of `prompt` (RequestError naming the field), its steps' prompts within
        the server's prompt limit, which truncate_prompt_tokens reads (regression: a ServerLimits.max_prompt_tokens
        below the engine's bounded only the truncation: -1 cut a prompt that fit to 1 token and searched it)."""
        self._search_params(prompt).validate(self.st.engine, prompt, self.st.prompt_limit)

    def choices(self, prompt: list[int], rids, index: int, batch_size: int) -> list["BeamChoice"]:
        """Prompt `index`'s n choices: its search's beams, best first (the search starts as they are read)."""
        total, search_params = batch_size * self.n, self._search_params(prompt)
        search = _Search(functools.partial(beam_search, self.st.engine, prompt, search_params,
                                           rids.engine_rid(index, batch_size)))
        params = dataclasses.replace(self.params, max_tokens=search_params.max_tokens)  # (its metrics' max_tokens)
        return [BeamChoice(self.st, Request(prompt=list(prompt), params=params,
                                            rid=rids.engine_rid(index * self.n + j, total)),
                           self.api_req, self.chat, self.arrival, index=index, batch_size=batch_size, choice=j,
                           n=self.n, search=search)
                for j in range(self.n)]


class _Search:
    """One prompt's search, shared by its n choices: started by the first to read it, cancelled by any abort
    (which then ends them all: BeamSearchError "abort")."""

    def __init__(self, run) -> None:
        self._run, self._task, self._cancelled = run, None, False

    async def result(self) -> BeamSearchResult:
        if self._task is None:
            self._task = asyncio.ensure_future(self._search())
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (read: no "never retrieved")
        try:
            return await asyncio.shield(self._task)  # (a reader cancelled does not cancel the search: `cancel` does)
        except asyncio.CancelledError:
            if self._task.cancelled() and not asyncio.current_task().cancelling():  # (cancelled before it began)
                raise BeamSearchError(_ABORTED, "abort") from None
            raise

    async def _search(self) -> BeamSearchResult:
        if self._cancelled:
            raise BeamSearchError(_ABORTED, "abort")
        try:
            return await self._run()
        except asyncio.CancelledError:  # (only `cancel` cancels it: its readers see an aborted search)
            raise BeamSearchError(_ABORTED, "abort") from None

    def cancel(self) -> None:
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()


class BeamChoice(Generation):
    """Choice `choice` of a prompt's search: its beam's tokens read as any choice's token events."""

    def __init__(self, *args, search: _Search, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.search, self.end_token = search, None

    async def steps(self):
        rid = self.req.rid
        try:
            result = await self.search.result()
        except BeamSearchError as exc:
            yield None, TokenEvent(rid, None, 0, finished=True, finish_reason=exc.finish_reason, error=str(exc))
            return
        beams = result.beams
        beam = beams[self.choice] if self.choice < len(beams) else None  # (fewer: end tokens crowded the rest out)
        req = self.req
        req.output = [] if beam is None else beam.output_ids
        req.hit_tokens, req.prompt_logprobs = dict(result.hit_tokens), result.prompt_logprobs or []
        self.end_token = None if beam is None else beam.end_token
        events = [TokenEvent(rid, t, i) for i, t in enumerate(req.output)]
        fin = TokenEvent(rid, None, len(events), finished=True, finish_reason="length" if beam is None
                         else beam.finish_reason)
        if events:  # (its time to first token: the whole search's; no inter-token gaps, they all came at once)
            self.st.metrics.ttft.observe(time.perf_counter() - self.arrival)
        for ev in events[:-1]:
            yield ev, None
        yield (events[-1] if events else None), fin

    async def events(self):
        """Generation.events of the beam's tokens, as one item of its whole text, then its end."""
        texts, ids, fin = [], [], None
        async with contextlib.aclosing(super().events()) as items:
            async for text, token_ids, fin, _ in items:
                texts.append(text)
                ids += token_ids
        if self.end_token is not None:  # (kept in its tokens or not, the reason names it, EOS too, as vLLM's beam
            self.stop_reason = self.end_token  # search's: its finished beams carry stop_reason=eos_token_id)
        if ids or "".join(texts):
            yield "".join(texts), ids, None, []
        yield "", [], fin, []

    async def abort(self, stop: bool = False) -> None:
        self.search.cancel()

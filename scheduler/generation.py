"""One engine request of an API request, read as a choice's text (scheduler/server.py admits it,
scheduler/choices.py renders a request's choices): its token events become text deltas (incremental
decoding after the prompt's context, stop strings matched, `tokenizer.IncrementalDecoder`,
`stop_strings.CompletionText`), logprobs entries where asked, and the server's metrics of it (time to
first token, each token's gap after the previous one, end to end and time per output token, its outcome,
finish reason, tokens, parameters and phases; scheduler/prom.py); its usage; its error when it failed or
was aborted; vLLM's `stop_reason` once it ended (`Generation.stop_reason`).
Times are taken as the server reads the tokens: the engine's loop and the server share one event loop, and each
choice is read by a task of its own (choices.merge), so that is as they are emitted, however slowly a stream's
client takes its chunks."""
from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import TYPE_CHECKING

import anyio
import structlog

from scheduler.api_models import APIError, Usage
from scheduler.logprobs import LogprobsShaper
from scheduler.request import Request as EngineRequest
from scheduler.request import TokenEvent
from scheduler.stop_strings import CompletionText

if TYPE_CHECKING:
    from scheduler.engine import Engine
    from scheduler.server import _ServerState

log = structlog.get_logger("scheduler.server")


class Generation:
    """One admitted engine request (choice `choice` of `n` of prompt `index` of a request of `batch_size`
    prompts; rendered by scheduler/choices.py): reads its token events as text, with its stop strings matched."""

    def __init__(self, st: "_ServerState", req: EngineRequest, api_req, chat: bool, arrival: float,
                 index: int = 0, batch_size: int = 1, choice: int = 0, n: int = 1) -> None:
        self.st, self.req, self.chat, self.arrival = st, req, chat, arrival
        self.index, self.batch_size, self.choice, self.n = index, batch_size, choice, n
        self.stop_strings, self.api_req = api_req.stop_strings(), api_req
        self.stop_ids = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            self.stop_ids.update(st.engine.model_config.eos_token_ids)
        self.output_tokens = 0  # tokens read (a stop string ends them before the engine's abort lands)
        # vLLM's stop_reason, set as it ends: the stop string that matched, or the stop token id that ended it
        self.stop_reason: str | int | None = None
        self.logprobs = None if req.params.logprobs is None else \
            LogprobsShaper(st.tokenizer, chat, api_req.skip_special_tokens, bool(api_req.return_tokens_as_token_ids))
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None  # (perf_counter when the latest token was read)
        self.prompt_choices = st.metrics.prompt_choice(api_req, index, choice)  # (its prompt's n choices' tally)
        self._buf: deque = deque()
        self._closed = self._counted = False

    async def _next(self):
        return self._buf.popleft() if self._buf else await self.req.queue.get()

    async def steps(self):
        """(token event or None, the finishing event or None); the last token and the end come together."""
        q = self.req.queue
        while True:
            ev = await self._next()
            if ev.finished:
                yield None, ev
                return
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
                self.st.metrics.ttft.observe(now - self.arrival)
                if self.req.scheduled_s is not None:  # (its prefill started before its first token)
                    self.st.metrics.queue.observe(self.req.scheduled_s - self.req.arrival_s)
            elif not ev.same_step:  # one gap per engine step (vLLM's inter-token latency: per iteration; a
                # verify step's tokens after its first come in the same iteration)
                self.st.metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
            if not self._buf and not q.empty():
                self._buf.append(q.get_nowait())
            if self._buf and self._buf[0].finished:
                yield ev, self._buf.popleft()
                return
            yield ev, None

    def _shows_text(self, token: int, fin) -> bool:
        """A stop token's text is left out, as vLLM leaves it (unless include_stop_str_in_output)."""
        stop = fin is not None and fin.finish_reason == "stop" and token in self.stop_ids
        return not stop or self.api_req.include_stop_str_in_output

    def _stop_token_reason(self, token: int) -> int | None:
        """The stop_reason of an end at `token` (vLLM's check_stop): none for the EOS (the tokenizer's eos_token,
        unless ignore_eos), even where stop_token_ids names it too; the id for one of stop_token_ids, or of the
        model's other EOS ids (vLLM adds its generation config's to stop_token_ids); none for any other token
        (a grammar that became whole)."""
        p, model = self.req.params, self.st.engine.model_config
        if not p.ignore_eos and token == eos_id(self.st.tokenizer, model.eos_token_id):
            return None
        return token if token in p.stop_token_ids or (not p.ignore_eos and token in model.eos_token_ids) else None

    def _finish(self, fin) -> None:
        m = self.st.metrics
        outcome = {"length": "success", "stop": "success", "abort": "aborted"}.get(fin.finish_reason, "failed")
        self._counted = True
        m.outcome(outcome)
        self._ended(fin.finish_reason, self.output_tokens)
        if outcome != "aborted":  # vLLM's finished requests: those its engine ended (stop, length, error)
            now = time.perf_counter()
            m.e2e.observe(now - self.arrival)
            if self.output_tokens >= 2 and self.first_token_at is not None:  # TPOT: (e2e - TTFT) / (tokens - 1)
                m.tpot.observe((now - self.first_token_at) / (self.output_tokens - 1))

    def _ended(self, finish_reason: str, generation_tokens: int) -> None:
        """Its end in the server's metrics (once: `_finish` or `close`); its prompt's n and the most tokens of
        its choices with its last choice's, and its phases from its first prefill's start and its first and
        last token as read (those of TTFT and the inter-token gaps) where it got a first token."""
        req, span_s = self.req, None
        if req.scheduled_s is not None and self.first_token_at is not None:
            span_s = (req.scheduled_s, self.first_token_at, self.last_token_at)
        most = self.prompt_choices.ended(generation_tokens)  # (None but for its prompt's last choice)
        self.st.metrics.ended(finish_reason, len(req.prompt), generation_tokens, req.params.max_tokens,
                              None if most is None else self.n, span_s, most, self.output_tokens)

    def usage(self) -> Usage:
        # the tokens read: after a stop string, those up to and including the one that completed its
        # match (vLLM's count), not the ones the engine made before the abort landed
        return Usage.of(len(self.req.prompt), self.output_tokens, self.req.served_hit_tokens)

    def fail(self, fin) -> APIError:
        """The error of a failed or aborted choice, naming its prompt in a batch and its choice under n > 1
        (regression: under n the message named the prompt only)."""
        where = [f"prompt {self.index} of the batch"] if self.batch_size > 1 else []
        where += [f"choice {self.choice} of {self.n}"] if self.n > 1 else []
        param = f"prompt.{self.index}" if self.batch_size > 1 else None
        where = f"{', '.join(where)}: " if where else ""
        if fin.finish_reason == "abort":
            return APIError(503, f"{where}the request was aborted (the server is shutting down or the client went "
                                 f"away)", param=param, code="aborted")
        return APIError(500, f"{where}the engine failed this request ({self.req.rid}, as the logs name it): "
                                f"{fin.error}", param=param, code="engine_error")

    async def abort(self, stop: bool = False) -> None:
        await abort_quietly(self.st.engine, self.req, stop)

    async def close(self, outcome: str = "aborted") -> None:
        """Abort the request unless it ended (the client went away, or the server is stopping; outcome "failed":
        the server raised as it served it)."""
        if not self._closed:
            self._closed = True
            try:
                if not self._counted:
                    self._counted = True
                    self.st.metrics.outcome(outcome)
                    self._ended("abort", len(self.req.output))
            finally:
                await self.abort()

    async def events(self):
        """(text, token ids, the finishing event or None, logprobs entries: its `LogprobsShaper.entry`
        when asked) per token as it arrives; the last token and the end come together. A completion's
        text continues its prompt's (a chat's answer is a new message: no context). A stop string's
        match ends it ("stop", the text before the match; through it with include_stop_str_in_output)
        and the engine request, which may still be generating (it finishes: Engine.abort's stop). Its
        `stop_reason` is set before the end is yielded."""
        last = None  # (the last token read: an end's event may come after it, on its own)
        text = CompletionText(self.st.tokenizer, [] if self.chat else self.req.prompt, self.stop_strings,
                              self.req.params.min_tokens, self.api_req.include_stop_str_in_output,
                              self.api_req.skip_special_tokens, self.api_req.spaces_between_special_tokens)
        async for ev, fin in self.steps():
            delta, token, entries = "", None if ev is None else ev.token_id, []
            if token is not None and self.logprobs is not None and ev.logprobs is not None:
                entries.append(self.logprobs.entry(token, ev.logprobs))
            if token is not None:
                self.output_tokens, last = self.output_tokens + 1, token
                # (counted as it comes, as vLLM counts per iteration: regression, counted only at the request's
                # end, so a dashboard's generation throughput read 0 through a long generation, then one spike)
                self.st.metrics.generation_tokens.inc()
                if self._shows_text(token, fin):
                    delta = text.feed(token)
            if fin is not None and fin.finish_reason in ("length", "stop"):
                delta += text.flush()
            if text.stopped:  # (a stop string wins over the stop token or EOS its text came with, as vLLM's)
                fin = TokenEvent(self.req.rid, None, self.output_tokens, finished=True, finish_reason="stop")
                self.stop_reason = text.matched
                await self.abort(stop=True)
            elif fin is not None and fin.finish_reason == "stop" and last is not None:
                self.stop_reason = self._stop_token_reason(last)
            if fin is not None:
                self._finish(fin)
            yield delta, [] if token is None else [token], fin, entries
            if fin is not None:
                return


def eos_id(tokenizer, model_eos_id: int | None) -> int | None:
    """The EOS of vLLM's check_stop: its tokenizer's eos_token (Llama 3.1's <|eot_id|>, where config.json lists
    <|end_of_text|> first), else the model's first EOS id (a tokenizer that names none: the byte-level one). Looked
    up once, not at every stop, and kept by the tokenizer itself (regression: an lru_cache of 8 kept the last 8
    tokenizers alive after their apps were gone, ~33 MB each at Qwen3's vocabulary)."""
    own = getattr(tokenizer, "_eos_id", _UNKNOWN)
    if own is _UNKNOWN:
        name = getattr(tokenizer, "special_tokens", {}).get("eos_token")
        ids = tokenizer.encode(name, add_special_tokens=False) if isinstance(name, str) and name else []
        own = ids[0] if len(ids) == 1 else None
        with contextlib.suppress(AttributeError):  # (a tokenizer that takes no attribute: looked up each time)
            tokenizer._eos_id = own
    return model_eos_id if own is None else own


_UNKNOWN = object()


async def abort_quietly(engine: "Engine", req: EngineRequest, stop: bool = False) -> None:
    """stop: a stop string ended it (it finishes and its KV is published: Engine.abort)."""
    if not req.state.done:
        with anyio.CancelScope(shield=True):
            try:
                await engine.abort(req.rid, stop=stop)
            except Exception:  # only after the loop crashed; the client has its error already
                log.exception("abort failed", rid=req.rid)

"""The choices of one API request, rendered as one JSON response or one event stream (scheduler/server.py).

A completion's `prompt` may be a list of prompts (OpenAI's batch), and each prompt gets `n` choices: each
choice is its own engine request (a server `Generation`, scheduler/generation.py; n of one prompt share its
K/V through the prefix cache), all run concurrently, and choice j of prompt p has `index` p * n + j (OpenAI's
order). A response carries the choices in that order and one usage: each prompt's tokens once (as OpenAI counts
them), every choice's completion tokens; a stream interleaves their chunks as their tokens arrive (each chunk
names its choice's `index`; a chat's first chunks are its choices' roles alone, `content` "", all before any content, as
vLLM's; calls a chat choice sends at its end come in a chunk before its finish chunk), then sends one usage chunk
(with stream_options.include_usage) and one `data: [DONE]`; with vLLM's stream_options.continuous_usage_stats too,
each choice chunk carries its choice's usage so far (its prompt's tokens, its own tokens so far: vLLM's per choice),
the usage chunk still the whole request's (without include_usage it sends nothing, as vLLM's).
A single prompt is a batch of one. A completion with `echo` (scheduler/api_inputs.py) sends each choice's
prompt text ahead of its own, in its first item (a stream's first chunk), with its prompt tokens' logprobs
first where `logprobs` is asked (the engine request's Request.prompt_logprobs, there by its first event).
vLLM's `prompt_logprobs` (scheduler/prompt_logprobs_api.py): a response's every completion choice carries its
prompt's, a chat's response carries them beside its choices; a stream, none.

Each choice carries vLLM's `stop_reason` (scheduler/generation.py), kept where a chat's finish_reason becomes
"tool_calls" (vLLM's); a stream's is in its choice's last chunk.
A choice that fails (the engine failed it, or it was aborted at shutdown) fails the whole request, as a
single request fails: the other choices are aborted; a response is that error (500, or 503 for an abort)
and a stream ends with it as an error event, then `data: [DONE]` (as it does where the server itself raises
while it streams: an `internal_error` event, as a whole response's 500); in a batch the error names the
prompt ("prompt 2 of the batch: ...", param "prompt.2"). A client that goes away aborts them all.
Each choice holds one of --max-concurrent-requests (server._Slot) and is counted in the metrics as a
request (its outcome, its tokens); a refused batch counts one rejection.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import anyio
import structlog
from fastapi.responses import JSONResponse

from scheduler import prompt_logprobs_api
from scheduler.api_inputs import echo_text
from scheduler.api_models import APIError, Usage, internal_error, response_body, stream_chunk, usage_chunk
from scheduler.chat_answer import ChatAnswer, Delta
from scheduler.logs import log_anyway
from scheduler.reasoning import ReasoningSplitter, ReasoningTokens, prompt_opens_thinking, think_markers

_END = object()
_DONE = "data: [DONE]\n\n"
log = structlog.get_logger("scheduler.server")


class Choices:
    """The engine requests (`Generation`s, n per prompt, in choice order) of one API request."""

    def __init__(self, gens: list, chat: bool, rid: str, api_req, model: str) -> None:
        self.gens, self.chat, self.rid, self.model = gens, chat, rid, model
        self.cut_short = "aborted"  # what those not ended count as when the response ends: failed where the server failed
        self.n = api_req.n or 1
        self.created = int(time.time())
        opts = api_req.stream_options
        self.includes_usage = opts is not None and bool(opts.include_usage)
        self.continuous_usage = self.includes_usage and bool(opts.continuous_usage_stats)
        # per choice, the prompt text its `echo` sends first (None: no echo)
        self.echoes = [echo_text(api_req, g.index, g.req.prompt, g.st.tokenizer) for g in gens]
        # vLLM's prompt_logprobs: the k a response shows of each prompt position (None: no such key)
        self.prompt_k = prompt_logprobs_api.shown_count(api_req, gens[0].st.engine.vocab_size)
        self.prompt_ids = bool(api_req.return_token_ids)  # vLLM's: the prompt's token ids too, where prompt_logprobs go
        for g, echo in zip(gens, self.echoes):
            if echo is not None and g.logprobs is not None:
                g.logprobs.follow_prompt(g.req.prompt)  # (before any token's entry is made)
        self.parses = chat and gens[0].st.limits.reasoning_parser is not None and gens[0].st.tokenizer is not None
        self.shows_reasoning = getattr(api_req, "include_reasoning", True)  # (vLLM's include_reasoning)
        # a guided answer is its grammar's from its first token: a think block the prompt left open is not its
        # (it is content), but one the grammar makes it write at its start is split off as any answer's
        # (regression: a guided answer was never split, so guided_regex's "<think>...</think>" came back as
        # content, and with tool_choice auto next to the calls read out of the rest)
        self.guided = gens[0].req.params.guided is not None
        # the final message the answer continues (continue_final_message): a thought it began is open
        final = api_req.messages[-1] if self.parses and not self.guided and api_req.continue_final_message else None
        self.continued = None if final is None else final.as_template_dict()["content"]
        self._opens_thinking: bool | None = None  # (a chat has one prompt: looked at once for its n choices)
        self._reasoning_tokens = [0] * len(gens)  # per choice, once it ended (--reasoning-parser's usage)
        self._counting: list[ReasoningTokens | None] = [None] * len(gens)  # per choice, its counter until it ended
        self._sent_tokens: list[int] | None = None  # a stream's, per choice: its tokens in the chunks rendered (`_sse`)
        # a chat's tool calls (scheduler/api_tools.py): "none", or read out of each choice's text
        self.tool_mode = api_req.tool_mode() if chat else "none"
        self.named = api_req.tool_choice.function.name if self.tool_mode == "named" else None
        self.single = chat and api_req.parallel_tool_calls is False

    def splitter(self, gen) -> ReasoningSplitter:
        """A chat choice's thinking / answer split (--reasoning-parser), thinking from the start when its
        prompt left a think block open (and its answer is not guided)."""
        if self.guided:
            return ReasoningSplitter(thinking=False)
        if self._opens_thinking is None:
            self._opens_thinking = prompt_opens_thinking(gen.st.tokenizer, gen.req.prompt, self.continued)
        return ReasoningSplitter(thinking=self._opens_thinking)

    def _answer(self, gen) -> ChatAnswer:
        """A chat choice's message as its text arrives: its thinking split off, its tool calls read."""
        return ChatAnswer(self.splitter(gen) if self.parses else None, self.tool_mode, self.named, self.single)

    async def abort(self) -> None:
        """The client went away: end every engine request (each stream then ends with 'abort')."""
        for g in self.gens:
            await g.abort()

    async def close(self, outcome: str = "aborted") -> None:
        """Abort what has not ended (counted as `outcome`: aborted, or failed where the server raised as it served
        them), once the response is over."""
        errors = []
        for g in self.gens:  # (every one, whichever raised)
            try:
                await g.close(outcome)
            except Exception as exc:  # (the first raised once all were closed)
                errors.append(exc)
        if errors:
            raise errors[0]

    def reasoning_counter(self, gen) -> ReasoningTokens | None:
        """A chat choice's reasoning tokens counted from its ids as its splitter splits its text (None: no
        parser; also the Responses API's logprobs split, scheduler/responses_output.py)."""
        if not (self.chat and self.parses):
            return None
        return ReasoningTokens(think_markers(gen.st.tokenizer), self.splitter(gen).thinking)

    def _ended(self, i: int, answer: ChatAnswer, counter: ReasoningTokens | None) -> None:
        # (an answer the split saw no thought in has none: the ids are only where the text is)
        self._reasoning_tokens[i] = counter.total() if counter is not None and answer.reasoned else 0
        self._counting[i] = None

    def usage_body(self) -> dict:
        """`usage()` as sent: with --reasoning-parser a chat's carries completion_tokens_details.reasoning_tokens
        too (vLLM's, with a parser only), its choices' summed: each counted once it ended, one a stream cut short
        (a background response cancelled) as its ids so far make it (regression: 0, with a whole output of
        reasoning)."""
        body = self.usage().model_dump()
        if self.parses:
            so_far = [c.total() if c is not None else n for c, n in zip(self._counting, self._reasoning_tokens)]
            body["completion_tokens_details"] = {"reasoning_tokens": sum(so_far)}
        return body

    def usage(self) -> Usage:
        """Each prompt once, with the cached tokens of its choice that hit least (what every choice had from
        the cache), and all its choices' completion tokens; then the prompts' summed. A stream's are those its chunks
        rendered, as its reasoning tokens are counted (regression: a stream cut short counted the tokens its choices'
        readers had read ahead, never rendered, in completion_tokens, not in reasoning_tokens, `merge`)."""
        per_prompt = []
        for p in range(0, len(self.gens), self.n):
            usages = [g.usage() for g in self.gens[p:p + self.n]]
            least = min(usages, key=lambda u: u.prompt_tokens_details.cached_tokens)
            sent = self._sent_tokens
            made = [u.completion_tokens for u in usages] if sent is None else sent[p:p + self.n]
            per_prompt.append(Usage.of(least.prompt_tokens, sum(made),
                                       least.cached_tokens_per_tier.model_dump()))
        return Usage.summed(per_prompt)

    def _events(self) -> AsyncIterator[tuple[int, tuple]]:
        return merge([g.events() if echo is None else _echoed(g, echo) for g, echo in zip(self.gens, self.echoes)])

    def _failed(self, gen, fin) -> APIError | None:
        """A choice's error where it ended otherwise than by length or stop; the engine's failure of one choice
        (a 500) makes the rest failed too, not aborted (regression: counted as though their client had left)."""
        if fin is None or fin.finish_reason in ("length", "stop"):
            return None
        error = gen.fail(fin)
        if error.status >= 500 and error.code != "aborted":
            self.cut_short = "failed"
        return error

    async def complete(self, request) -> JSONResponse:
        return JSONResponse(await self.body(request))

    async def body(self, request) -> dict:
        """The whole response's body (`complete`'s; /v1/responses renders it its way)."""
        watcher = asyncio.ensure_future(self._abort_on_disconnect(request))
        texts: list[list[str]] = [[] for _ in self.gens]
        ids: list[list[int]] = [[] for _ in self.gens]
        finish: list[str] = [""] * len(self.gens)
        logprobs: list[list] = [[] for _ in self.gens]
        failed = None
        try:
            async with contextlib.aclosing(self._events()) as events:
                async for i, (text, token_ids, fin, entries) in events:
                    texts[i].append(text)
                    ids[i] += token_ids
                    logprobs[i] += entries
                    if (failed := self._failed(self.gens[i], fin)) is not None:
                        break
                    if fin is not None:
                        finish[i] = fin.finish_reason
        except Exception:  # (a bug: the server's 500; what had not ended counts as failed, not as a client's abort)
            self.cut_short = "failed"
            raise
        finally:
            watcher.cancel()
            await self.close(self.cut_short)
        if failed is not None:
            raise failed
        shaped = [None if g.logprobs is None else g.logprobs.render(lps) for g, lps in zip(self.gens, logprobs)]
        texts = ["".join(t) for t in texts]
        reasoning = [None] * len(texts) if self.parses else None  # (the parser's key, null where none was split)
        calls = None
        if self.chat:
            answers = [self._answer(g) for g in self.gens]
            messages = [a.whole(text) for a, text in zip(answers, texts)]  # (reasoning, content, tool calls)
            for i, (gen, answer, token_ids) in enumerate(zip(self.gens, answers, ids)):
                if (counter := self.reasoning_counter(gen)) is not None:
                    counter.feed(token_ids)
                self._ended(i, answer, counter)
            if self.parses and self.shows_reasoning:
                reasoning = [r for r, _, _ in messages]
            texts, calls = [c for _, c, _ in messages], [tc for _, _, tc in messages]
            finish = [a.finish_reason(f) for a, f in zip(answers, finish)]
        body = response_body(self.chat, self.rid, self.created, self.model,
                             [(t, f, i, lp) for t, f, i, lp in zip(texts, finish, ids, shaped)], self.usage(),
                             reasoning, calls, [g.stop_reason for g in self.gens])
        body["usage"] = self.usage_body()
        if self.prompt_k is not None:
            self._put_prompt_logprobs(body)
        if self.prompt_ids:
            self._put_prompt_ids(body)
        return body

    def _put_prompt_ids(self, body: dict, index: int | None = None) -> None:
        """vLLM's return_token_ids: each prompt's token ids (the choices carry theirs anyway), a chat's at the top
        level, a completion's on each of its choices (a stream's on each choice's first chunk: `index`)."""
        if self.chat:
            body["prompt_token_ids"] = list(self.gens[0].req.prompt)
            return
        for choice in body["choices"]:
            choice["prompt_token_ids"] = list(self.gens[choice["index"] if index is None else index].req.prompt)

    def _put_prompt_logprobs(self, body: dict) -> None:
        """vLLM's `prompt_logprobs` (scheduler/prompt_logprobs_api.py): a completion's every choice its prompt's
        (its first choice's: the n computed alike), a chat's at the top level (its one prompt)."""
        per_prompt = [prompt_logprobs_api.render(g.req.prompt, g.req.prompt_logprobs, self.prompt_k, g.st.tokenizer)
                      for g in self.gens[::self.n]]
        if self.chat:
            body["prompt_logprobs"] = per_prompt[0]
            return
        for i, choice in enumerate(body["choices"]):
            choice["prompt_logprobs"] = per_prompt[i // self.n]

    async def _abort_on_disconnect(self, request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        await self.abort()

    def _chunk(self, i: int, text: str, token_ids: list[int], finish: str | None, entries: list, reasoning: str,
               calls: list | None, counter: ReasoningTokens | None, fin, first: bool = False) -> str:
        """One SSE chunk of choice i (a completion's first: `first`, its prompt's ids where asked); `fin`: its
        engine request's end (None: not this chunk's)."""
        usage: Usage | None | bool = None if self.includes_usage else False
        if self.continuous_usage:  # (its tokens as sent: its choice's reader may have read on, `merge`; regression)
            usage = self._usage_sent(i, self._sent_tokens[i])
        chunk = stream_chunk(self.chat, self.rid, self.created, self.model, text, token_ids, finish, False, usage,
                             index=i, logprobs=self.gens[i].logprobs.render(entries) if entries else None,
                             reasoning=reasoning, tool_calls=calls,
                             stop_reason=None if fin is None else self.gens[i].stop_reason)
        if self.prompt_ids and first and not self.chat:  # (a chat's: on its role chunk)
            self._put_prompt_ids(chunk, i)
        if counter is not None and self.continuous_usage:  # (this choice's so far, as vLLM's)
            so_far = self._reasoning_tokens[i] if fin is not None else counter.counted
            chunk["usage"]["completion_tokens_details"] = {"reasoning_tokens": so_far}
        return f"data: {json.dumps(chunk)}\n\n"

    def _usage_sent(self, i: int, completion_tokens: int) -> Usage:
        """Choice i's continuous usage: its prompt and cached tokens, and the `completion_tokens` its chunks sent."""
        so_far = self.gens[i].usage()
        return Usage.of(so_far.prompt_tokens, completion_tokens, so_far.cached_tokens_per_tier.model_dump())

    def _role_chunk(self, i: int) -> str:
        """A chat choice's first chunk, as vLLM sends it: the role alone, content "" (no token, no logprobs; the
        prompt's ids where asked; with continuous usage, none generated). The role rode on the first token's chunk,
        and the openai SDK's stream helper counted that chunk's logprobs twice for each choice after the first."""
        usage: Usage | None | bool = None if self.includes_usage else False
        if self.continuous_usage:
            usage = self._usage_sent(i, 0)
        chunk = stream_chunk(True, self.rid, self.created, self.model, "", [], None, True, usage, index=i)
        if self.prompt_ids:
            self._put_prompt_ids(chunk, i)
        if self.continuous_usage and self.parses:  # (a chat's counter exists exactly then: reasoning_counter)
            chunk["usage"]["completion_tokens_details"] = {"reasoning_tokens": 0}
        return f"data: {json.dumps(chunk)}\n\n"

    async def sse(self):
        """The stream's chunks. A raise (a bug: in a token's text, a stop string's matcher, logprobs, tool calls, a
        chunk's building) ends it with an internal_error event and `data: [DONE]`, the choices it left counted as
        failed; one in the clean-up after its [DONE] is only logged (regression: either raised out of the app after
        the 200, and the client's connection was cut mid-body: no error, no end)."""
        done = False
        try:
            try:
                async with contextlib.aclosing(self._sse()) as chunks:
                    async for chunk in chunks:
                        done = chunk == _DONE
                        yield chunk
            except Exception:
                self.cut_short = "failed"
                raise
            finally:
                await self.close(self.cut_short)
        except Exception as exc:
            log_anyway(log.exception, "stream_failed", rid=self.rid)
            if not done:
                yield f"data: {json.dumps(internal_error(exc).body())}\n\n"
                yield _DONE

    async def _sse(self):
        first, roles_sent = [True] * len(self.gens), False
        answers = [self._answer(g) for g in self.gens] if self.chat else None
        counters = self._counting = [self.reasoning_counter(g) for g in self.gens]
        self._sent_tokens = [0] * len(self.gens)  # per choice, its tokens in the chunks rendered so far
        async with contextlib.aclosing(self._events()) as events:
            async for i, (text, token_ids, fin, entries) in events:
                if (failed := self._failed(self.gens[i], fin)) is not None:
                    yield f"data: {json.dumps(failed.body())}\n\n"
                    break
                reasoning, calls, finish = "", None, None if fin is None else fin.finish_reason
                if answers is not None:
                    delta = answers[i].feed(text) + (answers[i].flush() if fin is not None else Delta())
                    reasoning = delta.reasoning if self.shows_reasoning else ""
                    text, calls = delta.content, delta.calls
                    finish = finish and answers[i].finish_reason(finish)
                counter = counters[i]
                self._sent_tokens[i] += len(token_ids)
                if counter is not None:
                    counter.feed(token_ids)
                if fin is not None and answers is not None:
                    self._ended(i, answers[i], counter)
                if self.chat and not roles_sent:  # (every choice's at once, before any content: vLLM's)
                    roles_sent = True
                    for j in range(len(self.gens)):
                        yield self._role_chunk(j)
                if calls and finish is not None:  # the calls in a chunk of their own, then the end (the SDK's
                    # stream helper looks for a finished call before it reads the calls of the finish chunk:
                    # the calls a "required" tool_choice sends at its end never had arguments.done)
                    yield self._chunk(i, text, token_ids, None, entries, reasoning, calls, counter, None)
                    text, token_ids, entries, reasoning, calls = "", [], [], "", None
                yield self._chunk(i, text, token_ids, finish, entries, reasoning, calls, counter, fin, first[i])
                first[i] = False
            else:
                if self.includes_usage:
                    usage = usage_chunk(self.chat, self.rid, self.created, self.model, self.usage())
                    usage["usage"] = self.usage_body()
                    yield f"data: {json.dumps(usage)}\n\n"
        yield _DONE


async def _echoed(gen, text: str) -> AsyncIterator[tuple]:
    """A choice's `events` with its prompt's text, and its prompt tokens' logprobs entries where asked, ahead
    of its first item's (a token's, or the end's: max_tokens 0)."""
    first = True
    async with contextlib.aclosing(gen.events()) as events:
        async for delta, token_ids, fin, entries in events:
            if first:
                first, delta = False, text + delta
                if gen.logprobs is not None:  # (its `logprobs` k of them: prompt_logprobs may have asked for more)
                    lps = prompt_logprobs_api.shorter(gen.req.prompt_logprobs, gen.req.params.logprobs)
                    entries = gen.logprobs.prompt_entries(gen.req.prompt, lps) + entries
            yield delta, token_ids, fin, entries


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(position, item) of several async iterators, in the order their items arrive, each read by a task of its own
    as its items come, one alone too: a choice's stop string then ends its engine request whatever pace its client
    reads the merge at (regression: one choice was read as its client took its chunks, and a stalled client's
    request ran on to max_tokens). Closing it cancels the readers."""
    queue: asyncio.Queue = asyncio.Queue()

    async def read(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
        except Exception as exc:  # raised to the reader of the merge (a bug: a 500 / a broken stream)
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, _END))

    readers = [asyncio.ensure_future(read(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(readers)
        while live:
            i, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for r in readers:
            r.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*readers, return_exceptions=True)

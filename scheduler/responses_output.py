"""A /v1/responses request's one choice rendered as a Response (scheduler/api_responses.py), whole or as
Responses' server-sent events (`event: <type>` / `data: {"type", "sequence_number", ...}`).

Both are made from what scheduler/choices.py renders for the chat completion that serves the request: a whole
response from its message, a stream from its chunks (their reasoning_content, content and tool_calls deltas,
as scheduler/chat_answer.py makes them), by one `OutputItems`, so that a stream's items add up to the whole
response's. The items: a `reasoning` item (with --reasoning-parser, where the answer thought), a `message`
with one output_text part, a `function_call` per call. A stream finishes each item before it starts the next
(as OpenAI's do), so text that follows a call (the hermes parser's "auto") is a second message there, and
part of the one message in a whole response: their `output_text` is the same, and so is the conversation a follow-up
reads from them (api_responses.items_messages continues a turn's text after a call). finish_reason "length" is
status "incomplete" (incomplete_details.reason "max_output_tokens", the last item "incomplete"); a choice
that failed ends a stream with an `error` event and `response.failed`. A Response kept (scheduler/responses_store.py)
is handed to its `keep` as it was sent, once it ended: a stream's when its last event is made; a background
response's by its run (scheduler/responses_background.py), which records the events a stream sends
(`ResponseOutput.events`; `sse` formats them). A failed one is kept too (OpenAI's: GET reads it, its error set, and a
follow-up naming it is a 400): a stream's `response.failed` Response, a whole response's made of its 500's message
(no output: the client saw none); not one aborted (its client went away, or the server stops: code "aborted").
"""
from __future__ import annotations

import contextlib
import itertools
import json
import time
import uuid
from typing import TYPE_CHECKING, Callable

import structlog
from fastapi.responses import JSONResponse

from scheduler.api_models import APIError, internal_error
from scheduler.logs import log_anyway
from scheduler.responses_logprobs import AnswerLogprobs, event_form

if TYPE_CHECKING:
    from scheduler.api_responses import ResponsesRequest
    from scheduler.choices import Choices

log = structlog.get_logger("scheduler.server")

_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


class OutputItems:
    """A Response's output items, made from a chat message's deltas in order (a whole message is one delta):
    `feed` and `close` return the stream's events for them (without sequence numbers); `items`: the finished
    items. `logprobs` (include "message.output_text.logprobs"): each output_text part and its events carry its
    tokens' logprobs, those `feed` is given with each delta's content (scheduler/responses_logprobs.py). With
    logprobs, an output_text delta is held back until the next event (or its item's end), so that the logprobs of
    the tokens of no text that may end the answer (an EOS whose text is left out, an id that decodes to nothing)
    join the text's last delta: no delta is empty (none of OpenAI's is), and the deltas' logprobs add up to the
    output_text's. (It waits one chunk, or while the chat holds text back: a call being written, say.)"""

    def __init__(self, logprobs: bool = False) -> None:
        self.items: list[dict] = []
        self.logprobs = logprobs
        self._open: dict | None = None  # the item being written (as it was added)
        self._text: list[str] = []  # its text, or its arguments
        self._entries: list[dict] = []  # its text's tokens' logprobs (a message's)
        self._held: list[dict] = []  # the output_text delta held back (with logprobs), not yet sent

    def feed(self, delta: dict, logprobs: list[dict] = ()) -> list[dict]:
        """`logprobs`: the chat entries of the tokens of the delta's content."""
        events = []
        if delta.get("reasoning_content"):
            events += self._write("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._write("message", delta["content"], list(logprobs))
        # logprobs alone: a stream's last tokens, of no text, that its text's last delta (held) takes; none
        # held where a call that came with the text ended the message (the tokens are dropped: no text is open)
        elif logprobs and self._held:
            self._entries += logprobs
            self._held[-1]["logprobs"] += event_form(logprobs)
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id") is not None:  # (a call's first delta: its id and name)
                events += self.finish("completed") + self._start("function_call", call_id=call["id"],
                                                                 name=function.get("name") or "")
            if function.get("arguments") and self._open is not None and self._open["type"] == "function_call":
                events += self._write("function_call", function["arguments"])
        return events

    def close(self, status: str) -> list[dict]:
        """The end of the answer: the open item finished with `status`; an answer with nothing in it is an empty
        message (a client reads the answer's text from one)."""
        events = self.finish(status)
        if not self.items:
            events += self._start("message") + self.finish(status)
        return events

    def finish(self, status: str) -> list[dict]:
        """The open item finished with `status` (none open: no events)."""
        item, self._open = self._open, None
        held, self._held = self._held, []
        if item is None:
            return held
        text, kind, entries = "".join(self._text), item["type"], self._entries
        where = {"item_id": item["id"], "output_index": len(self.items)}
        if kind == "function_call":
            done = {**item, "arguments": text, "status": status}
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": text}]
        else:
            part = self._part(kind, text, entries)
            done = {**item, "content": [part], "status": status}
            events = [{"type": "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done",
                       **where, "content_index": 0, "text": text,
                       **({} if kind == "reasoning" else {"logprobs": event_form(entries)})},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        self.items.append(done)
        events.append({"type": "response.output_item.done", "output_index": where["output_index"], "item": done})
        return held + events

    def _start(self, kind: str, **fields) -> list[dict]:
        item = {"id": f"{_PREFIXES[kind]}_{uuid.uuid4().hex}", "type": kind, **fields}
        if kind == "reasoning":
            item.update(summary=[], content=[])
        elif kind == "message":
            item.update(role="assistant", content=[])
        else:
            item.update(arguments="")
        item["status"] = "in_progress"
        self._open, self._text, self._entries = item, [], []
        where = {"item_id": item["id"], "output_index": len(self.items)}
        events = [{"type": "response.output_item.added", "output_index": len(self.items), "item": item}]
        if kind != "function_call":
            events.append({"type": "response.content_part.added", **where, "content_index": 0,
                           "part": self._part(kind, "", [])})
        return events

    def _write(self, kind: str, text: str, entries: list[dict] = ()) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.finish("completed") + self._start(kind)
        self._text.append(text)
        self._entries += entries
        where = {"item_id": self._open["id"], "output_index": len(self.items)}
        if kind == "function_call":
            return events + [{"type": "response.function_call_arguments.delta", **where, "delta": text}]
        if kind == "reasoning":
            return events + [{"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": text}]
        delta = {"type": "response.output_text.delta", **where, "content_index": 0, "delta": text,
                 "logprobs": event_form(entries)}
        if not self.logprobs:
            return events + [delta]
        events, self._held = events + self._held, [delta]  # (the one held before it sent: nothing joins it now)
        return events

    def _part(self, kind: str, text: str, entries: list[dict]) -> dict:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        part = {"type": "output_text", "text": text, "annotations": []}
        if self.logprobs:
            part["logprobs"] = list(entries)
        return part


def sse_block(event: dict) -> str:
    """One event as a server-sent event: `event: <type>` and its data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(usage: dict) -> dict:
    """A chat's usage as Responses' (Choices.usage_body's): its reasoning tokens those --reasoning-parser counted
    (scheduler/reasoning.py's ReasoningTokens; 0 without a parser); no cache writes billed."""
    reasoning_tokens = usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage["total_tokens"]}


class ResponseOutput:
    """The Choices (one) of a /v1/responses request rendered as a Response; server._generate serves it as it
    serves Choices (`complete`, `sse`, `abort`, `close`), a background response's run reads its `events`. keep:
    takes the finished Response to keep (none: it is not kept, and says `"store": false`)."""

    def __init__(self, choices: "Choices", req: "ResponsesRequest",
                 keep: Callable[[dict], None] | None = None) -> None:
        self.choices, self.req, self.keep = choices, req, keep
        self.id = "resp_" + choices.rid.partition("-")[2]  # (the engine request's id, for the logs)
        self.params = choices.gens[0].req.params  # (the sampling settings it ran with, the defaults filled)
        self.logprobs = req.includes_logprobs()
        self.background = req.background is True  # (run detached from its request: responses_background.py)
        self._numbers = itertools.count()  # the stream's events' sequence_number
        self._items: OutputItems | None = None  # the stream's items, once it started (cut_short finishes them)

    def _answer_logprobs(self) -> AnswerLogprobs:
        """The answer's output_text's logprobs, its think block's tokens left out by its ids (--reasoning-parser:
        thinking from the start where the chat's split starts so, its prompt having opened the block)."""
        return AnswerLogprobs(self.choices.reasoning_counter(self.choices.gens[0]))

    def _entries(self, shaper: AnswerLogprobs | None, choice: dict, delta: dict) -> list[dict]:
        if shaper is None or not choice.get("logprobs"):
            return []
        return shaper.feed(choice.get("token_ids") or [], choice["logprobs"]["content"], delta,
                           last=choice.get("finish_reason") is not None)

    async def abort(self) -> None:
        await self.choices.abort()

    async def close(self) -> None:
        await self.choices.close()

    async def complete(self, request) -> JSONResponse:
        """The whole Response; where it failed (the engine failed its request, or a bug raised: the 500 the client
        gets), the failed Response kept, its error the 500's message (regression: not kept, GET was a 404 where a
        stream's failed Response was kept)."""
        try:
            chat = await self.choices.body(request)
            [choice] = chat["choices"]
            items, status = OutputItems(self.logprobs), _status(choice["finish_reason"])
            message = choice["message"]  # (its reasoning_content, content and tool_calls: one delta)
            shaper = self._answer_logprobs() if self.logprobs else None
            items.feed(message, self._entries(shaper, choice, message))
            items.close(status)
            return JSONResponse(self._kept(self.response(status, items.items, _usage(chat["usage"]))))
        except Exception as exc:
            error = exc if isinstance(exc, APIError) else internal_error(exc)
            if error.status >= 500:
                self._kept_failed(self.response("failed", [], error={"code": "server_error", "message": error.message}),
                                  aborted=error.code == "aborted")
            raise

    async def sse(self):
        """The stream's events as server-sent events. A raise (a bug: in an event's making, in keeping the Response)
        ends it with an `error` event, then `cut_short`'s `response.failed` (regression: it raised out of the app after
        the 200, and the client's connection was cut mid-body: no error, no end)."""
        try:
            async with contextlib.aclosing(self.events()) as events:
                async for event in events:
                    yield sse_block(event)
        except Exception as exc:
            log_anyway(log.exception, "response_stream_failed", response_id=self.id)
            error = internal_error(exc)
            yield sse_block(self._numbered({"type": "error", "code": error.code, "message": error.message,
                                            "param": None}))
            ending = self.cut_short("failed", {"code": "server_error", "message": error.message})
            self._kept_failed(ending[-1]["response"])
            for event in ending:
                yield sse_block(event)

    async def events(self):
        """The stream's events, numbered from 0 (`sequence_number`): a stream sends them, a background response
        records them (scheduler/responses_background.py). A background response is "queued" as it is created, and
        says so in a `response.queued` event before it is "in_progress", as OpenAI's."""
        self._items = OutputItems(self.logprobs)
        event = self._numbered
        head = self.response("in_progress", [])
        if self.background:
            queued = {**head, "status": "queued"}
            yield event({"type": "response.created", "response": queued})
            yield event({"type": "response.queued", "response": queued})
        else:
            yield event({"type": "response.created", "response": head})
        yield event({"type": "response.in_progress", "response": head})
        items, finish = self._items, None
        shaper = self._answer_logprobs() if self.logprobs else None
        async with contextlib.aclosing(self.choices.sse()) as chunks:
            async for line in chunks:
                if not line.startswith("data: {"):  # (the chat's "data: [DONE]")
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:  # the choice failed, or was aborted (scheduler/choices.py)
                    error = chunk["error"]
                    for e in items.finish("incomplete"):
                        yield event(e)
                    yield event({"type": "error", "code": error["code"], "message": error["message"],
                                 "param": error["param"]})
                    failed = self.response("failed", items.items, error={"code": "server_error",
                                                                         "message": error["message"]})
                    self._kept_failed(failed, aborted=error["code"] == "aborted")
                    yield event({"type": "response.failed", "response": failed})
                    return
                choice = chunk["choices"][0]
                for e in items.feed(choice["delta"], self._entries(shaper, choice, choice["delta"])):
                    yield event(e)
                finish = choice["finish_reason"] or finish
        status = _status(finish)
        for e in items.close(status):
            yield event(e)
        usage = _usage(self.choices.usage_body())
        yield event({"type": f"response.{status}", "response": self._kept(self.response(status, items.items, usage))})

    def cut_short(self, status: str, error: dict | None = None) -> list[dict]:
        """The last events of a stream that `events` did not end (a background run cancelled, or failed by a bug:
        scheduler/responses_background.py), numbered on from its last: the item it was writing finished
        "incomplete", then `response.<status>` (`response.cancelled`, the name of OpenAI's webhook event for it, or
        `response.failed`) with the Response: every item so far, the usage so far. So a client following the stream
        sees it end, and the Response holds what was streamed (regression: a cancelled stream stopped on a delta,
        its message never done, and GET's output left the message out)."""
        items = self._items if self._items is not None else OutputItems(self.logprobs)
        events = [self._numbered(e) for e in items.finish("incomplete")]
        response = self.response(status, items.items, _usage(self.choices.usage_body()), error=error)
        return [*events, self._numbered({"type": f"response.{status}", "response": response})]

    def _numbered(self, data: dict) -> dict:
        return {**data, "sequence_number": next(self._numbers)}

    def _kept(self, response: dict) -> dict:
        """A finished Response, kept where asked (before it is sent: a follow-up may come as soon as it is read); a
        background response's by its run, failed too (scheduler/responses_background.py)."""
        if self.keep is not None and not self.background:
            self.keep(response)
        return response

    def _kept_failed(self, response: dict, aborted: bool = False) -> None:
        """A failed Response kept as `_kept` keeps a finished one, unless it was `aborted` (its client went away, or
        the server stops: nobody reads it back); a raise keeping it is only logged (the failure is the answer)."""
        if self.keep is not None and not self.background and not aborted:
            try:
                self.keep(response)
            except Exception:  # noqa: BLE001
                log_anyway(log.exception, "response_not_kept", response_id=self.id)

    def response(self, status: str, output: list[dict], usage: dict | None = None, error: dict | None = None) -> dict:
        """The Response object, with the request's settings echoed as the openai SDK's Response wants them."""
        req = self.req
        fmt = req.text.format if req.text is not None else None
        text = {"format": {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)}
        if req.text is not None and req.text.verbosity is not None:
            text["verbosity"] = req.text.verbosity
        choice = req.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.choices.created, "status": status,
            # (OpenAI's: when it completed, only when it did; made as it ends, so kept and GET as it was sent)
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.choices.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": None if req.reasoning is None else req.reasoning.model_dump(),
            "store": self.keep is not None,  # (kept once it finishes: scheduler/responses_store.py)
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": text,
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else choice or "auto",
            "tools": [t.model_dump() for t in req.tools or ()], "truncation": "disabled", "usage": usage,
            "user": req.user, "metadata": req.metadata or {}, "background": self.background,
            # (accepted, changing nothing: scheduler/api_responses.py)
            "top_logprobs": req.top_logprobs, "max_tool_calls": req.max_tool_calls,
            "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention, "safety_identifier": req.safety_identifier}

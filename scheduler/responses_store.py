"""The Responses API's kept responses (scheduler/api_responses.py): what `previous_response_id`, GET / DELETE
/v1/responses/{id} and GET /v1/responses/{id}/input_items read, as OpenAI and vLLM keep them.

A response is kept when it ended (completed, incomplete or failed, whole or streamed) and its request left `store`
true (the default). A failed one (OpenAI's: the engine failed its request, or a bug raised) is kept as the client last
saw it: a stream's `response.failed` Response, or, for a whole response's 500, a failed Response of that error's
message and no output (scheduler/responses_output.py); GET reads it, its input_items are listed, DELETE drops it,
and a follow-up naming it is a 400 (no conversation to follow). One aborted (its client went away, or the server
stops) is not kept. Per id, a `StoredResponse`: the Response as it was sent, the conversation it ends as a
chat's messages, and the request's input items as given (ids added to those without one, a message's string
content as one text part, as OpenAI lists them). The conversation: the one it followed (previous_response_id's),
the request's input items and the response's output items as the messages that the same items sent back as
`input` make (api_responses.items_messages: a function_call is the assistant's tool call, a reasoning item its
thinking), without the request's `instructions` (OpenAI's: a follow-up's own instructions apply, first, as a system
message). A follow-up's prompt then starts as its predecessor's did (with the same instructions), and the prefix
cache serves that part.

A background response (scheduler/responses_background.py) is kept from its start, with its run (its events and
its current state: GET's while it runs): running, it cannot be followed (a 400 naming previous_response_id: it
has no conversation yet), nor once it failed or was cancelled; its final Response, failed or cancelled too, is
kept as it ends. Its id is claimed from its request's check to its run's start (`claim`): a request of the id in
between is refused as one while it runs; and a response of the id that finishes while it runs is not kept over it.

Bounded by a count (--responses-store-max; 0: nothing kept) and by the bytes of their JSON (--responses-store-max-mib:
a response's, its input items', its conversation's and a finished background run's events'; Python's objects take
some five times that):
the response used least recently (kept, followed or read by GET) dropped first, a background one's events with it;
one still running is not dropped (the running ones are bounded by --max-concurrent-requests), and a finished one
larger than the whole bound is not kept (a warning). (Regression: 40 responses of 2,000 tokens with logprobs took
640 MiB under the count alone.) In memory, on the server's one event loop: no locks. A kept
conversation is never changed (a new response's is a new tuple; the messages are shared between the responses of
one chain), and a request gets its own copy.
"""
from __future__ import annotations

import copy
import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import structlog

from scheduler.api_models import APIError
from scheduler.api_responses import as_items, input_items, items_messages, not_found

if TYPE_CHECKING:
    from scheduler.api_responses import ResponsesRequest
    from scheduler.responses_background import BackgroundRun

log = structlog.get_logger("scheduler.server")

# an input item's id where it came without one (as OpenAI's, by its type)
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
MAX_PAGE_ITEMS = 100  # input_items' `limit`, 1 to this (OpenAI's)


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as sent (GET's)
    conversation: tuple[dict, ...]  # chat messages: earlier turns, this input, this output (no instructions)
    input_items: tuple[dict, ...]  # the request's input items as given, each with an id (input_items')
    item_ids: frozenset[str] = frozenset()  # every item id of its chain: earlier turns', this input's, its output's

    @property
    def id(self) -> str:
        return self.response["id"]

    def history(self) -> list[dict]:
        """The conversation for a follow-up's chat body: a copy (the chat path may not change the kept one)."""
        return copy.deepcopy(list(self.conversation))


def json_bytes(value) -> int:
    """The bytes of `value` as JSON (what the bound counts a kept response by)."""
    return len(json.dumps(value, separators=(",", ":")))


class ResponsesStore:
    """Kept responses by id, at most `max_responses` (0: none) and `max_bytes` of their JSON, in order of use (the
    least recently used first)."""

    def __init__(self, max_responses: int, max_bytes: int = 64 << 20) -> None:
        self.max_responses, self.max_bytes = max(0, max_responses), max_bytes
        self.kept_bytes = 0  # the kept responses' JSON bytes (`_size`)
        self._sizes: dict[str, int] = {}
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._runs: dict[str, BackgroundRun] = {}  # the kept background responses' runs, by id
        # the request_ids of background requests between their check (ResponsesShape.chat_body) and their run's
        # start: `running` already, so that a second request of the id, checked meanwhile, is refused too
        self._claimed: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._kept

    def put(self, stored: StoredResponse, run: BackgroundRun | None = None) -> None:
        """Kept as the most recently used (an id kept again replaced), with its background run (None: not a
        background response); the least recently used dropped above the bound, but for those still running."""
        if not self.enabled:
            return
        if run is None and self._run_going(stored.id):
            # (a request of the id that passed its check before a background one of it started: kept, it would put
            # the run out of every route's reach)
            log.warning("response_not_kept", response_id=stored.id, reason="a background response of its id runs")
            return
        self._claimed.discard(stored.id)
        size = self._size(stored, run)
        if size > self.max_bytes and not (run is not None and not run.finished and not _ended(stored.response)):
            log.warning("response_not_kept", response_id=stored.id, reason=f"its {size:,} bytes of JSON exceed "
                        f"--responses-store-max-mib's {self.max_bytes:,}")
            self._drop(stored.id)
            return
        self._drop(stored.id)
        self._kept[stored.id] = stored
        self._sizes[stored.id] = size
        self.kept_bytes += size
        if run is not None:
            self._runs[stored.id] = run
        # the least recently used first (found at the front unless running)
        for response_id in [i for i in self._kept if i != stored.id and not self.running(i)]:
            if len(self._kept) <= self.max_responses and self.kept_bytes <= self.max_bytes:
                break
            self._drop(response_id)

    def _size(self, stored: StoredResponse, run: BackgroundRun | None) -> int:
        """A kept response's bytes of JSON: the Response, its input items, the conversation it ends and its run's
        events so far. (The conversation's messages are shared with the kept turns before it in its chain, and
        counted with each: a bound, the earlier turns going first. Regression, session 58's hunt: uncounted, the
        latest turn of each long conversation kept its whole history beyond --responses-store-max-mib.)"""
        events = sum(json_bytes(e) for e in run.events) if run is not None else 0
        return json_bytes(stored.response) + json_bytes(stored.input_items) + json_bytes(stored.conversation) + events

    def _drop(self, response_id: str) -> None:
        if self._kept.pop(response_id, None) is not None:
            self.kept_bytes -= self._sizes.pop(response_id)
        self._runs.pop(response_id, None)

    def running(self, response_id: str) -> bool:
        """Whether a background response of this id is kept and still running, or about to start (`claim`)."""
        return response_id in self._claimed or self._run_going(response_id)

    def _run_going(self, response_id: str) -> bool:
        run = self._runs.get(response_id)
        return run is not None and not run.finished

    def claim(self, response_id: str) -> None:
        """A background request of this id passed its check: `running` until its run is kept or `release`."""
        self._claimed.add(response_id)

    def release(self, response_id: str) -> None:
        self._claimed.discard(response_id)

    def run(self, response_id: str) -> BackgroundRun | None:
        """A kept response's background run (None: not a background response; a 404 where none is kept)."""
        self._use(response_id)
        return self._runs.get(response_id)

    def holds(self, run: BackgroundRun) -> bool:
        """Whether `run` is the background run of the response kept under its id (not dropped, nor replaced)."""
        return self._runs.get(run.id) is run

    def _use(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self._kept.get(response_id)
        if stored is None:
            raise not_found(response_id, param)
        self._kept.move_to_end(response_id)
        return stored

    def prior(self, response_id: str) -> StoredResponse:
        """The kept response a request's previous_response_id names (a 404 naming that field otherwise); a 400 for
        one that has no conversation to follow: a background response running, or a response failed or cancelled."""
        stored = self._use(response_id, "previous_response_id")
        status = self.response(response_id).get("status")
        if status in ("queued", "in_progress"):
            raise APIError(400, f"response {response_id!r} has not finished (status {status!r}): it has no "
                                f"conversation to follow yet; wait until it ends (GET /v1/responses/{{id}})",
                           param="previous_response_id", code="invalid_value")
        if status in ("failed", "cancelled"):
            raise APIError(400, f"response {response_id!r} {status}: it has no conversation to follow",
                           param="previous_response_id", code="invalid_value")
        return stored

    def conversation(self, response_id: str) -> list[dict]:
        """A copy of the conversation a kept response ends."""
        return self._use(response_id).history()

    def response(self, response_id: str) -> dict:
        """GET /v1/responses/{id}: the Response as it was sent; a background one's as it is now."""
        stored, run = self._use(response_id), self._runs.get(response_id)
        return stored.response if run is None else run.response

    def delete(self, response_id: str) -> dict:
        """DELETE /v1/responses/{id}: OpenAI's answer (a 404 where none is kept)."""
        if response_id not in self._kept:
            raise not_found(response_id)
        self._drop(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def input_items(self, response_id: str, order: str = "desc", limit: int = 20, after: str | None = None,
                    before: str | None = None) -> dict:
        """GET /v1/responses/{id}/input_items: OpenAI's list of the request's input items (`order` "desc", its
        default: the last first), a page of `limit` after the item `after` or before the item `before`."""
        stored = self._use(response_id)
        if order not in ("asc", "desc"):
            raise APIError(400, f"'order' must be 'asc' or 'desc', got {order!r}", param="order",
                           code="invalid_value")
        if not 1 <= limit <= MAX_PAGE_ITEMS:
            raise APIError(400, f"'limit' must be 1 to {MAX_PAGE_ITEMS}, got {limit}", param="limit",
                           code="invalid_value")
        items = list(stored.input_items if order == "asc" else reversed(stored.input_items))
        ids = [item["id"] for item in items]
        for name, cursor in (("after", after), ("before", before)):
            if cursor is not None and cursor not in ids:
                raise APIError(400, f"'{name}': no input item {cursor!r} in response {response_id!r}", param=name,
                               code="invalid_value")
        window = items[ids.index(after) + 1 if after is not None else 0:
                       ids.index(before) if before is not None else len(items)]
        page = window[-limit:] if before is not None and after is None else window[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(page) < len(window)}

    def keeper(self, req: ResponsesRequest, prior: StoredResponse | None) -> Callable[..., None] | None:
        """What keeps `req`'s Response once it finished, after the conversation of `prior` (the response it
        follows), with its background run where it has one; None where it is not to be kept (`store` false, or
        none kept)."""
        if not self.enabled or req.store is False:
            return None
        history = () if prior is None else prior.conversation
        given = input_item_dicts(req)
        items = input_items(req)

        def keep(response: dict, run: BackgroundRun | None = None) -> None:
            turn = items_messages(items + as_items(response["output"]))
            ids = (frozenset() if prior is None else prior.item_ids).union(
                item["id"] for item in (*given, *response["output"]) if isinstance(item.get("id"), str))
            self.put(StoredResponse(response, (*history, *turn), given, ids), run)
        return keep


def input_item_dicts(req: ResponsesRequest) -> tuple[dict, ...]:
    """The request's input items as given, an id added to each without one; a message's string content as one
    text part, as OpenAI lists it (a string input: one user message of an input_text part). (Regression: a string
    content was listed as it was, where the SDK's item types have a list of parts: it read a user's message as an
    assistant's output message.)"""
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else \
        [item.model_dump(by_alias=True, exclude_none=True) for item in req.input]
    given = []
    for data in items:
        kind = data.get("type") or "message"
        if kind == "message" and isinstance(data["content"], str):
            data["content"] = [_text_part(data["role"], data["content"])]
        given.append({"id": data.pop("id", None) or f"{_ID_PREFIXES[kind]}_{uuid.uuid4().hex}", "type": kind, **data})
    return tuple(given)


def _text_part(role: str, text: str) -> dict:
    """A message's text as OpenAI's part: an assistant's output_text, anyone else's input_text."""
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def _ended(response: dict) -> bool:
    return response.get("status") not in ("queued", "in_progress")

"""vLLM's request ids: the id a client names its request by, carried into the response and the structured logs
(the timeline's rids), so a gateway's or a client's log lines can be joined with the engine's.

* `request_id` (a body field of /v1/completions, /v1/chat/completions and /v1/responses, as vLLM's): 1 to
  MAX_CHARS printable ASCII characters without whitespace, since it lands in log lines and headers (vLLM takes
  any string); anything else is a 400 naming it.
* The X-Request-Id header names a completion or a chat before the body's request_id (vLLM's precedence,
  OpenAIServing._base_request_id); an empty header counts as none, a bad one is a 400. vLLM's Responses read
  the body's field alone, and so do they here.
* The response's id is vLLM's: `cmpl-{id}`, `chatcmpl-{id}`, a Response's the id as given (vLLM's default for
  none: resp_{uuid}); without an id, a fresh uuid stands for it.
* The engine's rids: the response's id, a client's id followed by 8 random hex digits, then `-{k}` for choice k
  of a batch or of n > 1 (vLLM's order: its prompt index, then its suffix). Two requests in flight may carry
  one id, as vLLM has allowed since it added that suffix (its #27987): the engine's ids stay unique
  (Engine.add_request refuses a duplicate) while each response carries the id as given.
* --enable-request-id-headers (RequestIdHeaders, vLLM's XRequestIdMiddleware): every HTTP response carries
  X-Request-Id, the request's header, else the id a generation ran under (vLLM's: a fresh uuid there).
"""
from __future__ import annotations

import re
import secrets
import uuid
from dataclasses import dataclass

from pydantic import BaseModel, StrictStr, field_validator
from pydantic_core import PydanticCustomError
from starlette.datastructures import Headers, MutableHeaders

MAX_CHARS = 256
HEADER = "X-Request-Id"
PARAM = "request_id"
_STATE_KEY = "hicache_request_id"  # (request.state: the id RequestIdHeaders echoes when the request had none)
_PRINTABLE = re.compile(r"[\x21-\x7e]*")  # (ASCII's printable characters less the space)


def problem(value: str) -> str | None:
    """Why `value` cannot be a request id (None: it can)."""
    if not value:
        return "must not be empty"
    if len(value) > MAX_CHARS:
        return f"must be at most {MAX_CHARS} characters, got {len(value)}"
    if not _PRINTABLE.fullmatch(value):
        at = next(i for i, ch in enumerate(value) if not "\x21" <= ch <= "\x7e")
        return f"must be printable ASCII without whitespace (it lands in log lines and headers), got " \
               f"{value[at]!r} at {at}"
    return None


class RequestIdField(BaseModel):
    """The request field (mixed into api_models._SamplingFields and api_responses.ResponsesRequest)."""
    request_id: StrictStr | None = None

    @field_validator("request_id")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        if value is not None and (why := problem(value)) is not None:
            raise PydanticCustomError("invalid_request_id", "{why}", {"why": why})
        return value


@dataclass(frozen=True)
class RequestIds:
    """One HTTP request's ids: the one it runs under (given or made), its response's, its engine requests'."""
    request_id: str
    response_id: str
    base_rid: str

    def engine_rid(self, k: int, total: int) -> str:
        """Engine request k (choice prompt_index * n + j) of `total`."""
        return self.base_rid if total == 1 else f"{self.base_rid}-{k}"


def resolve_ids(request, body_id: str | None, chat: bool, read_header: bool = True) -> RequestIds:
    """The ids of a generation (`body_id`: the body's request_id, already checked; `read_header`: False for a
    Response, which vLLM names by its body alone); the id is kept on request.state for RequestIdHeaders."""
    given = body_id
    header = request.headers.get(HEADER) if read_header else None
    if header:
        if (why := problem(header)) is not None:
            from scheduler.api_models import APIError  # (api_models imports this module for its field)
            raise APIError(400, f"the {HEADER} header {why}", param=PARAM, code="invalid_value")
        given = header
    prefix = "chatcmpl" if chat else "cmpl"
    if given is None:
        fresh = uuid.uuid4().hex  # (unique already: no suffix, the rids as before)
        ids = RequestIds(fresh, f"{prefix}-{fresh}", f"{prefix}-{fresh}")
    else:
        ids = RequestIds(given, f"{prefix}-{given}", f"{prefix}-{given}-{secrets.token_hex(4)}")
    setattr(request.state, _STATE_KEY, ids.request_id)
    return ids


class RequestIdHeaders:
    """--enable-request-id-headers: X-Request-Id on every HTTP response (streamed ones too: it is set as the
    response starts), the request's own header, else the id its generation ran under, else a fresh uuid."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                request_id = Headers(scope=scope).get(HEADER) or scope.get("state", {}).get(_STATE_KEY)
                MutableHeaders(scope=message).append(HEADER, request_id or uuid.uuid4().hex)
            await send(message)

        await self.app(scope, receive, send_with_id)

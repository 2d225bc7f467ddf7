"""OpenAI's Responses API (`POST /v1/responses`), the basic form vLLM serves, so that clients built on it (the
openai SDK's `client.responses.create` / `.stream`, the OpenAI Agents SDK) work against this server.

A Responses body is validated here (strict, as every request model: scheduler/api_models.py), translated into
a chat completion's body and served as one (server._generate: the same prompts, limits, tools, structured
outputs and engine requests as /v1/chat/completions); its one choice is rendered as a Response, whole or as
Responses' server-sent events (scheduler/responses_output.py).

* `input`: a string (one user message) or a list of items: messages ({"role": user / system / developer /
  assistant, "content": a string or input_text / output_text parts}, with or without "type": "message"),
  `function_call` items (an assistant message's tool_calls; consecutive assistant-side items, a reasoning
  item's text too, make one assistant turn), `function_call_output` items (tool messages). An earlier
  response's `output` items may be sent back as they came. `instructions`: a system message first.
* `tools`: Responses' flat function tools (other tool types: a 400 naming them); `tool_choice`,
  `parallel_tool_calls` as a chat's (scheduler/api_tools.py); `text.format` as `response_format`;
  `max_output_tokens` as `max_completion_tokens` (none: the rest of the context, as a chat's).
* Kept responses (scheduler/responses_store.py, as OpenAI's and vLLM's): a response finished with `store` true (the
  default) is kept, whole or streamed, and says `"store": true`, up to --responses-store-max (0: none kept, each says
  false) and --responses-store-max-mib of JSON, those used least recently dropped first. `previous_response_id`:
  the kept conversation (its input and output; not its instructions, as OpenAI's) comes after this request's
  instructions and before its input, so that its prompt starts as the earlier one's did (the prefix cache serves
  it); an unknown id is a 404 naming it.
  GET / DELETE /v1/responses/{id} and GET .../input_items (server.py). `conversation` is a 400.
* `reasoning.effort` is the chat's `reasoning_effort` (vLLM's: a chat template variable, with enable_thinking;
  scheduler/openai_fields.py). Accepted and changing nothing: `reasoning`'s other fields, `metadata` (echoed),
  `user`, `truncation` "disabled" ("auto": a 400), and at its neutral values `service_tier`.
* `background: true` (kept responses only: with `store` false, or a server that keeps none, a 400 naming it): the
  response runs detached from its request, answered "queued" at once (or streamed), read by GET as it goes,
  followed by GET ?stream=true&starting_after=N, cancelled by POST /v1/responses/{id}/cancel
  (scheduler/responses_background.py). A request_id naming one still running is a 400.
  vLLM's `seed`, `cache_salt`, `top_k`, `logit_bias`, `skip_special_tokens` and `priority` are passed on.
* `include: ["message.output_text.logprobs"]`: the chat's `logprobs: true` with `top_logprobs` (0..20, 0 when
  left out) alternatives, on the output_text and its events (scheduler/responses_logprobs.py); `top_logprobs`
  without it is accepted, echoed, and asks for nothing (vLLM's). What stateless agents send (Codex,
  the Agents SDK; each was a 400): `include: ["reasoning.encrypted_content"]` (reasoning items carry their text,
  taken back as it came), `text.verbosity`, `prompt_cache_key` and `prompt_cache_retention` (the prefix cache
  finds shared prefixes itself), `safety_identifier`, `max_tool_calls` (OpenAI's bound on built-in tools' calls:
  none here), `stream_options.include_obfuscation` (no obfuscation is sent); echoed where a Response has them.

Errors are the API's 400s naming the Responses field (`ResponsesShape.named_errors`: a chat field's name
becomes the one it was translated from). A lone surrogate ("\\ud800", which JSON carries and UTF-8 cannot) is a 400
naming its field, whichever it is (`_check_unicode`).
"""
from __future__ import annotations

import contextlib
import json
import re
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from scheduler.api_inputs import check_texts
from scheduler.api_models import APIError, Float, _is_type_tag, _Strict, validation_error
from scheduler.openai_fields import Metadata
from scheduler.request import MAX_LOGPROBS
from scheduler.request_ids import RequestIdField
from scheduler.responses_items import (_INPUT_ITEM, _ITEMS, FunctionCallItem, FunctionCallOutputItem, InputItem,
                                       MessageItem, TextPart, _item_kind)
from scheduler.responses_output import ResponseOutput

if TYPE_CHECKING:
    from scheduler.responses_store import ResponsesStore, StoredResponse

_INPUT_ITEMS_ROUTE = "/input_items"  # (GET /v1/responses/{id}/input_items: an id ending so names no Response)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def chat_form(self) -> dict:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunction(_Strict):
    type: Literal["function"]
    name: StrictStr


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _named(self) -> "TextFormat":
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs its 'name' and 'schema'")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # (a hint to OpenAI's models: echoed, unused)


class StreamOptions(_Strict):
    include_obfuscation: StrictBool | None = None  # (no delta carries OpenAI's obfuscation padding)


class ReasoningConfig(_Strict):
    effort: StrictStr | None = None
    summary: StrictStr | None = None
    generate_summary: StrictStr | None = None


class ResponsesRequest(_Strict, RequestIdField):  # (request_id: vLLM's, the Response's id as given)
    model: StrictStr | None = None
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    seed: StrictInt | None = None  # (vLLM's: a sampled answer repeated)
    cache_salt: StrictStr | None = None  # (vLLM's: its prefixes shared only within the salt)
    # vLLM's, as its chat takes them (checked there: their errors name these fields)
    top_k: StrictInt | None = None
    logit_bias: dict[StrictStr, Float] | None = None
    skip_special_tokens: StrictBool | None = None
    priority: StrictInt | None = None
    stream: StrictBool | None = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Metadata | None = None
    user: StrictStr | None = None
    store: StrictBool | None = None  # (none: true, as OpenAI's)
    truncation: Literal["disabled", "auto"] | None = None
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # (alone: nothing asked, vLLM's)
    include: list[StrictStr] | None = None
    background: StrictBool | None = None
    service_tier: StrictStr | None = None
    # what stateless agents send, changing nothing here (echoed)
    stream_options: StreamOptions | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: StrictStr | None = None
    max_tool_calls: Annotated[StrictInt, Field(ge=0)] | None = None

    # fields taken only at a value that changes nothing (others: an 'unsupported_value' 400)
    NEUTRAL: ClassVar[dict[str, tuple]] = {"truncation": (None, "disabled"), "service_tier": (None, "auto", "default")}
    # `include`'s items taken: the output_text's token logprobs (scheduler/responses_logprobs.py); one that
    # changes nothing: a reasoning item's text is in it, not encrypted
    LOGPROBS_INCLUDE: ClassVar[str] = "message.output_text.logprobs"
    INCLUDES: ClassVar[tuple[str, ...]] = ("reasoning.encrypted_content", LOGPROBS_INCLUDE)

    def includes_logprobs(self) -> bool:
        return self.LOGPROBS_INCLUDE in (self.include or ())

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, items: Any) -> Any:
        """Each item validated here, so that its error names the item and its field (through the union of a
        string and a list it was only "Input should be a valid string; or Field required")."""
        if not isinstance(items, list):
            return items
        valid = []
        for i, item in enumerate(items):
            kind = _item_kind(item) if isinstance(item, dict) else None
            if kind is not None and not isinstance(kind, str):  # (a list's or an object's: a TypeError, a 500)
                raise PydanticCustomError("invalid_item", "item {i}: 'type' must be a string such as 'message', "
                                          "got {kind}", {"i": i, "kind": json.dumps(kind)[:80]})
            if kind is not None and kind not in _ITEMS:
                raise PydanticCustomError("unsupported_value", "item {i} is of type {kind}, which this server does "
                                          "not take (messages, function_call, function_call_output and reasoning "
                                          "items; no item_reference: send previous_response_id)",
                                          {"i": i, "kind": repr(kind)})
            try:
                valid.append(_INPUT_ITEM.validate_python(item))
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"][1:] if not _is_type_tag(str(p)))
                kind = err["type"] if err["type"] == "unsupported_value" else "invalid_item"
                raise PydanticCustomError(kind, "item {i} ({item}): {where}{msg}",
                                          {"i": i, "item": err["loc"][0] if err["loc"] else "?",
                                           "where": f"'{where}': " if where else "", "msg": err["msg"]}) from None
        _unique_ids(valid)
        return valid

    @field_validator("request_id")
    @classmethod
    def _routable(cls, value: str | None) -> str | None:
        """A Response's id (the request_id as given) that GET /v1/responses/{id} can read (regression: one ending in
        /input_items was kept, and GET gave another response's input items or a 404)."""
        if value is not None and value.endswith(_INPUT_ITEMS_ROUTE):
            raise PydanticCustomError("invalid_request_id", "must not end in {route} (GET /v1/responses/<id>"
                                      "{route} reads a response's input items)", {"route": _INPUT_ITEMS_ROUTE})
        if value in (".", ".."):  # (a dot-segment: HTTP clients normalize it away and the openai SDK refuses to
            # send it, so its Response could never be read or deleted; regression: it was kept all the same)
            raise PydanticCustomError("invalid_request_id", "must not be '{value}', a dot-segment of a URL path "
                                      "(GET /v1/responses/<id> could not name it)", {"value": value})
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise PydanticCustomError("unsupported_value", "tools of type {kind} are not supported (this server "
                                          "calls function tools only)", {"kind": repr(kind)})
        return tools

    def check_unsupported(self) -> None:
        if self.conversation is not None:
            raise APIError(400, "'conversation' is not supported: this server keeps responses, not conversations; "
                                "send 'previous_response_id' or the whole conversation as 'input'",
                           param="conversation", code="unsupported_value")
        for name, neutral in self.NEUTRAL.items():
            value = getattr(self, name)
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise APIError(400, f"'{name}' is not supported (only {' or '.join(json.dumps(v) for v in neutral)})",
                               param=name, code="unsupported_value")
        for value in self.include or ():
            if value not in self.INCLUDES:
                raise APIError(400, f"'include' of {value!r} is not supported (only "
                                    f"{', '.join(map(repr, self.INCLUDES))})",
                               param="include", code="unsupported_value")


def _unique_ids(items: list) -> None:
    """OpenAI's 400 for an id two items carry: input_items' `after` cursor names an item by its id (regression: the
    SDK's pagination found the first of two and went round forever)."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        if item.id is not None and first.setdefault(item.id, i) != i:
            raise PydanticCustomError("invalid_item", "item {i}: duplicate id {id} (item {j}'s); each item's id must be "
                                      "unique", {"i": i, "id": repr(item.id), "j": first[item.id]})


def _check_unicode(body: dict) -> None:
    """Each field's text UTF-8 can carry: a lone surrogate in a field the Response echoes (metadata, user,
    reasoning, text) failed its rendering after the answer was generated, a 500, and one in `instructions` was
    blamed on 'input', as 'the messages' (regressions)."""
    for name, value in body.items():
        check_texts([json.dumps(value, ensure_ascii=False)], name)


def parse_request(body: dict) -> ResponsesRequest:
    """A decoded JSON body as a ResponsesRequest (a 400 naming the field otherwise)."""
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    _check_unicode(body)
    req.check_unsupported()
    return req


def input_items(req: ResponsesRequest) -> list:
    """The request's input as items (a string: one user message)."""
    return [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else list(req.input)


def as_items(data: list[dict]) -> list:
    """Items as the API gives them (an earlier response's output items) as input items."""
    return [_INPUT_ITEM.validate_python(item) for item in data]


def not_found(response_id: str, param: str | None = None) -> APIError:
    """No kept response of this id (unknown, not stored, dropped or deleted): vLLM's 404, OpenAI's error shape."""
    return APIError(404, f"Response with id {response_id!r} not found", param=param, type="invalid_request_error",
                    code="response_not_found" if param is None else "previous_response_not_found")


def chat_messages(req: ResponsesRequest, history: list[dict] = ()) -> list[dict]:
    """The request's messages: its instructions (a system message), `history` (the kept conversation it follows,
    previous_response_id's), its input items."""
    system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    return system + list(history) + items_messages(input_items(req))


def items_messages(items: list) -> list[dict]:
    """Input items as a chat's messages: consecutive assistant-side items (an assistant message, function
    calls, reasoning) one assistant message, as a chat answer of text, calls and thinking is. A message after a
    call continues the turn's text, as the answer's content is its text around its calls (regression: a stream's
    text after a call, its second message item, was a second text part, joined by "\n": a follow-up's prompt had
    a token more than the answer's and the whole response's follow-up)."""
    messages: list[dict] = []
    turn: dict | None = None  # the assistant message the assistant-side items go to
    after_call = False  # a call came since the turn's text was last written
    for item in items:
        if isinstance(item, FunctionCallOutputItem):
            turn = None
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output)})
        elif isinstance(item, MessageItem) and item.role != "assistant":
            turn = None
            messages.append({"role": item.role, "content": _content(item.content)})
        else:
            if turn is None:
                turn, after_call = {"role": "assistant", "content": None}, False
                messages.append(turn)
            if isinstance(item, MessageItem):
                parts = _content(item.content)
                parts = parts if isinstance(parts, list) else [{"type": "text", "text": parts}]
                if after_call and turn["content"] and parts:
                    turn["content"][-1]["text"] += parts[0]["text"]
                    parts = parts[1:]
                turn["content"], after_call = (turn["content"] or []) + parts, False
            elif isinstance(item, FunctionCallItem):
                after_call = True
                turn.setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                           "arguments": item.arguments}})
            else:
                thought = turn.get("reasoning_content")
                turn["reasoning_content"] = item.text() if thought is None else f"{thought}\n{item.text()}"
    return messages


def _content(content: str | list[TextPart]) -> str | list[dict]:
    return content if isinstance(content, str) else [{"type": "text", "text": p.text} for p in content]


def chat_body(req: ResponsesRequest, history: list[dict] = ()) -> dict:
    """The chat completion body that serves `req` (its fields left out where `req` leaves them out), after the
    conversation `history`."""
    body: dict[str, Any] = {
        "messages": chat_messages(req, history), "model": req.model, "stream": req.stream, "temperature": req.temperature,
        "top_p": req.top_p, "seed": req.seed, "cache_salt": req.cache_salt, "user": req.user, "max_completion_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls, "reasoning_effort": req.reasoning and req.reasoning.effort,
        "top_k": req.top_k, "logit_bias": req.logit_bias, "skip_special_tokens": req.skip_special_tokens,
        "priority": req.priority,
        "tools": None if req.tools is None else [t.chat_form() for t in req.tools]}
    choice = req.tool_choice
    body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
        if isinstance(choice, NamedFunction) else choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.model_dump(include={"name", "schema_", "description", "strict"}, by_alias=True, exclude_none=True)
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    if req.includes_logprobs():  # (top_logprobs without it asks for nothing, as vLLM's)
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return {k: v for k, v in body.items() if v is not None}


# a chat field's name in an error -> the Responses field it was translated from (max_tokens: the engine's name
# for the limit, in its refusal of prompt + max tokens)
_FIELDS = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "response_format": "text", "reasoning_effort": "reasoning.effort"}
_MAX_TOKENS = re.compile(r"\bmax_(?:completion_)?tokens\b")  # (the word, quoted or not: "max_tokens (2040)")


class ResponsesShape:
    """One /v1/responses request served as a chat completion (server._generate): its body translated
    (`chat_body`), after the kept conversation it follows; its choice rendered as a Response (`output`), kept
    when it asks; its errors named by its own fields. store: the server's kept responses (none: none kept)."""

    def __init__(self, store: ResponsesStore | None = None) -> None:
        self.req: ResponsesRequest | None = None
        self.store = store
        self.prior: StoredResponse | None = None  # the kept response it follows
        self._claimed: str | None = None  # its request_id, claimed in the store until its background run starts

    def chat_body(self, body: dict) -> dict:
        self.req = parse_request(body)
        if self.store is not None and self.req.request_id is not None and self.store.running(self.req.request_id):
            # (regression: its response, kept at its end, replaced the run's: the run went on, out of reach)
            raise APIError(400, f"request_id {self.req.request_id!r} names a background response still running; "
                                f"cancel it or wait until it ends", param="request_id", code="invalid_value")
        if (previous := self.req.previous_response_id) is not None:
            if self.store is None:
                raise not_found(previous, "previous_response_id")
            self.prior = self.store.prior(previous)
            for item in self.req.input if isinstance(self.req.input, list) else ():
                if item.id is not None and item.id in self.prior.item_ids:  # (OpenAI's 400: it was served twice)
                    raise APIError(400, f"Duplicate item found with id {item.id}. Remove duplicate items from your "
                                        f"input (previous_response_id {previous!r} holds it)", param="input",
                                   code="invalid_value")
        if self.req.background and (self.store is None or not self.store.enabled or self.req.store is False):
            raise APIError(400, "background can only be used when `store` is true" + (
                "" if self.req.store is False else " (this server keeps no responses: --responses-store-max 0)"),
                param="background", code="invalid_value")
        body = chat_body(self.req, [] if self.prior is None else self.prior.history())
        if self.req.background and self.req.request_id is not None:  # (regression: two such POSTs of one new id,
            # checked while neither had started, both ran; the second kept put the first out of reach)
            self._claimed = self.req.request_id
            self.store.claim(self._claimed)
        return body

    def release_claim(self) -> None:
        """Its request_id's claim given back: its run started (and is kept), or it failed before."""
        if self._claimed is not None:
            self.store.release(self._claimed)
            self._claimed = None

    def output(self, choices) -> ResponseOutput:
        keep = None if self.store is None else self.store.keeper(self.req, self.prior)
        out = ResponseOutput(choices, self.req, keep)
        if self.req.request_id is not None:  # (vLLM's: the id as given, not resp_-prefixed)
            out.id = self.req.request_id
        return out

    @contextlib.contextmanager
    def named_errors(self):
        """An APIError from the chat path names the Responses field (not 'max_completion_tokens' to a body that
        never had it); one of the Responses body itself, as it came (regression: an unknown field 'max_tokens' in it
        was called 'max_output_tokens', 'prompt' called 'input')."""
        try:
            yield
        except APIError as exc:
            if self.req is None:  # (not translated yet: the body's own error)
                raise
            if exc.param is not None:
                head, dot, rest = exc.param.partition(".")
                if head in _FIELDS:
                    exc.param = _FIELDS[head] if head in ("messages", "prompt") else _FIELDS[head] + dot + rest
            exc.message = _MAX_TOKENS.sub("max_output_tokens", exc.message)
            for old, new in _FIELDS.items():
                exc.message = exc.message.replace(f"'{old}'", f"'{new}'")
            raise

"""Request / response bodies of the OpenAI-compatible API, and the one error shape every failure uses:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "..."}}

Request models are strict: unknown fields and wrong JSON types are errors (400), never coerced; OpenAI
fields this server does not implement are served at their neutral values only (any other value: an
'unsupported_value' 400); OpenAI's fields that change nothing (metadata, store, ...), a chat's reasoning_effort
(a template variable) and its fields served at their neutral values only: scheduler/openai_fields.py. Tools and
tool calls: scheduler/api_tools.py. Token logprobs: scheduler/logprobs.py
(vLLM's prompt_logprobs: scheduler/prompt_logprobs_api.py); penalties and logit_bias, min_tokens:
scheduler/penalties.py; top_k, min_p: scheduler/sampler_fields.py.
Token ids are what this engine speaks: `stop` as integers and `stop_token_ids` are token ids (the stop
token is in `token_ids` but its text is left out); `stop` as a string or a list of up to 4 strings is
matched on the generated text (scheduler/stop_strings.py: the text ends before the match, finish_reason
"stop"). Every choice carries the generated `token_ids` next to the text, and vLLM's `stop_reason`: the stop
string that matched, the stop token id that ended it, or null (scheduler/generation.py `Generation.stop_reason`).
A completion's `prompt` is a string, token ids, or a list of either (OpenAI's batch); each prompt gets `n`
choices (1..N_MAX), each its own engine request, `index` prompt_index * n + j (scheduler/choices.py). `read_json_body` (size limits, JSON) and
scheduler/api_inputs.py's `parse_prompts` (validation, limits, prompt ids, SamplingParams; `echo`) turn an HTTP
body into engine input; `response_body` / `stream_chunk` render results.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from scheduler.api_guided import GuidedFields
from scheduler.ban_fields import BanFields
from scheduler.beam_search import BeamSearchFields
from scheduler.api_tools import ToolFields
from scheduler.chat_messages import ChatMessage
from scheduler.logprobs import ChatLogprobsFields, CompletionLogprobsField
from scheduler.openai_fields import OpenAIChatFields, OpenAIMetadataFields
from scheduler.penalties import PenaltyFields
from scheduler.prompt_logprobs_api import PromptLogprobsField
from scheduler.prompt_truncation import TruncationField
from scheduler.request_ids import RequestIdField
from scheduler.sampler_fields import SamplerFields
from scheduler.stop_strings import check_stop_strings

Float = Annotated[float, Field(strict=True)]  # accepts JSON numbers (ints too), never strings
TokenIds = list[StrictInt]
N_MAX = 16  # `n`'s cap: each choice is an engine request (a decode, a concurrency slot): one body's fan-out stays small


class APIError(Exception):
    """An error answered to the client as the JSON error body with `status` (a 4xx unless the
    engine itself failed)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        # (a body's field name quoted in it may hold a lone surrogate, which JSON carries and UTF-8 cannot: written
        # as its escape, or the error could not be sent; regression: a 500 for '{"\\ud800": NaN}', on every route)
        message, param = _sendable(message), None if param is None else _sendable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _DEFAULT_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _sendable(text: str) -> str:
    """`text` as UTF-8 can carry it: a lone surrogate as its backslash escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def internal_error(exc: BaseException) -> APIError:
    """A bug's error as the client gets it: a response's 500, or a stream's last error event (its status sent)."""
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


_DEFAULT_TYPES = {404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                  503: "service_unavailable"}


MAX_JSON_DEPTH = 128  # a body's nesting (objects and arrays): a schema or message deeper is no request served


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: StrictBool | None = False  # (null: false, as vLLM takes it)
    continuous_usage_stats: StrictBool | None = False  # vLLM's: each chunk its choice's usage (scheduler/choices.py)
    include_obfuscation: StrictBool | None = None  # OpenAI's (the SDK's typed field): no obfuscation is sent here


class _SamplingFields(_Strict, PenaltyFields, SamplerFields, GuidedFields, TruncationField, BanFields,
                      PromptLogprobsField, RequestIdField, BeamSearchFields):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    seed: StrictInt | None = None
    stop: StrictInt | TokenIds | StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False  # vLLM's: the text ends after a stop string, or a stop token's
    skip_special_tokens: StrictBool = True  # vLLM's: special tokens' text left out of the choice's text
    # vLLM's: with skip_special_tokens false, False joins an added token to one right before it without the
    # decoder's space (scheduler/tokenizer.IncrementalDecoder)
    spaces_between_special_tokens: StrictBool = True
    return_token_ids: StrictBool | None = None  # vLLM's: the prompt's token ids in the response (choices.py)
    stream: StrictBool | None = False  # (null: the default, as OpenAI's schema allows)
    stream_options: StreamOptions | None = None
    n: StrictInt | None = 1
    user: StrictStr | None = None
    priority: StrictInt = 0  # vLLM's: lower is admitted first (only under --scheduling-policy priority)
    cache_salt: StrictStr | None = None  # vLLM's: prefixes shared only among requests of this salt (request.salted_prompt)

    # OpenAI fields this server takes only at a value that changes nothing: (name, neutral values);
    # any other value is an "unsupported" 400 (it was "unknown field", as if the name were a typo)
    NEUTRAL: ClassVar[tuple[tuple[str, tuple], ...]] = ()

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` given as text (a string or a list of strings), matched on the generated text."""
        # (`stop` as one token id is an int: iterating it was a 500, regression)
        stop = [self.stop] if isinstance(self.stop, (str, int)) else self.stop or ()
        stops = [s for s in stop if isinstance(s, str)]
        try:
            return check_stop_strings(stops)
        except ValueError as exc:
            raise APIError(400, str(exc), param="stop", code="invalid_value") from None

    def stop_ids(self) -> tuple[int, ...]:
        stop: list[int] = []
        if isinstance(self.stop, int):
            stop.append(self.stop)
        elif self.stop and not isinstance(self.stop, str):
            stop.extend(t for t in self.stop if isinstance(t, int))
        for param, ids in (("stop", stop), ("stop_token_ids", self.stop_token_ids or ())):  # (the field at fault)
            for t in ids:
                if t < 0:
                    raise APIError(400, f"{param}: token id {t} must be >= 0", param=param, code="invalid_value")
        return tuple(dict.fromkeys([*stop, *(self.stop_token_ids or ())]))

    def check_unsupported(self) -> None:
        if self.n is not None and not 1 <= self.n <= N_MAX:
            raise APIError(400, f"'n' must be in [1, {N_MAX}], got {self.n}", param="n", code="invalid_value")
        for name, neutral in self.NEUTRAL:
            value = getattr(self, name)
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise APIError(400, f"'{name}' is not supported (only {' or '.join(json.dumps(v) for v in neutral)})",
                               param=name, code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options",
                           code="invalid_value")


class CompletionRequest(OpenAIMetadataFields, _SamplingFields, CompletionLogprobsField):  # (NEUTRAL: the mixin's)
    # OpenAI's four shapes; a list of prompts is a batch: n choices per prompt (parse_prompts)
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    echo: StrictBool | None = False  # the prompt ahead of each choice (scheduler/api_inputs.py)
    add_special_tokens: StrictBool = True  # vLLM's: a text prompt encoded with the tokenizer's BOS (or without)
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of not in (None, 1):
            raise APIError(400, "'best_of' must be 1", param="best_of", code="unsupported_value")
        if self.best_of == 1 and (self.n or 1) > 1:  # (OpenAI's and vLLM's 400; it was accepted)
            raise APIError(400, f"'best_of' must be >= 'n' (got 1 and {self.n})", param="best_of", code="invalid_value")
        if self.suffix:
            raise APIError(400, "'suffix' is not supported", param="suffix", code="unsupported_value")


class ChatTemplateFields(BaseModel):
    """vLLM's options for rendering a chat (a chat completion's, /tokenize's chat form; api_inputs.chat_ids)."""
    add_generation_prompt: StrictBool = True  # the assistant turn's opening markup after the messages
    continue_final_message: StrictBool = False  # the last message left open for the model to continue
    add_special_tokens: StrictBool = False  # (the template writes them)
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables: Qwen3's enable_thinking
    chat_template: StrictStr | None = None  # vLLM's: the request's own, with --trust-request-chat-template only


class ChatCompletionRequest(OpenAIChatFields, _SamplingFields, ChatLogprobsFields, ChatTemplateFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    # vLLM's: false leaves the thinking out of the answer (reasoning_content null; usage still counts it)
    include_reasoning: StrictBool = True

    def _asks(self):
        """The guided fields' grammars, and a "required" or named tool_choice's (two at once: a 400)."""
        yield from super()._asks()
        yield "tool_choice", self.tool_spec()


# -- responses -------------------------------------------------------------------------------------
class TierTokens(BaseModel):
    l1: int = 0
    l2: int = 0
    l3: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    cached_tokens_per_tier: TierTokens

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, hit_tokens: dict[str, int]) -> "Usage":
        tiers = TierTokens(**{k: int(hit_tokens.get(k, 0)) for k in ("l1", "l2", "l3")})
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=tiers.l1 + tiers.l2 + tiers.l3),
                   cached_tokens_per_tier=tiers)

    @classmethod
    def summed(cls, usages: list["Usage"]) -> "Usage":
        """A batch of prompts' usage: its choices' added up (OpenAI's one usage per response)."""
        tiers = {k: sum(getattr(u.cached_tokens_per_tier, k) for u in usages) for k in ("l1", "l2", "l3")}
        return cls.of(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages), tiers)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's (its key always there: null where none)
    logprobs: dict | None = None  # (scheduler/logprobs.py's shapes)
    token_ids: list[int]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # (null: tool calls and no text)
    reasoning_content: str | None = None  # only with --reasoning-parser (scheduler/reasoning.py)
    tool_calls: list[dict] | None = None  # only where calls were made (scheduler/chat_answer.py)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's (its key always there: null where none)
    logprobs: dict | None = None
    token_ids: list[int]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def validation_error(exc: ValidationError | Any) -> APIError:
    """The first pydantic / FastAPI validation error as a 400 that names the field."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return APIError(400, "invalid request body", code="invalid_request")
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if loc[:1] in (["query"], ["path"]):  # (a route parameter's: named by itself, not where it came from)
        loc = loc[1:]
    # drop union-branch tags such as 'str' / 'list[int]' / 'int' that pydantic inserts in the path
    path = [str(p) for p in loc if isinstance(p, int) or not _is_type_tag(str(p))]
    field = ".".join(path) or "body"
    # (the whole path, as the server's other errors of nested fields name theirs: logit_bias.5, prompt.1; regression:
    # a bad messages.1.content or stream_options.include_usage was named 'messages' / 'stream_options' alone)
    param = field if path else None
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field '{field}' (extra fields are not permitted)", param=param,
                        code="unknown_field")
    if kind == "unsupported_value":
        return APIError(400, f"{field}: {err.get('msg')}", param=param, code="unsupported_value")
    if kind == "missing":
        return APIError(400, f"missing required field '{field}'", param=param, code="missing_field")
    if kind == "string_unicode":  # a key holding "\\ud800" (a value may; regression: "... field 'body' ...")
        where, key = f" in '{field}'" if path else "", err.get("input")
        if err.get("loc", ())[-1:] == ("[key]",):  # (a dict's key, which pydantic's path mangles: the dict named)
            param = ".".join(path[:-1]) or None
        return APIError(400, f"field name {key!r}{where} holds a lone surrogate, which UTF-8 cannot carry",
                        param=param, code="invalid_value")
    branches = [e.get("msg", "") for e in errors if e.get("loc", ())[:1] == err.get("loc", ())[:1]]
    msg = "; or ".join(dict.fromkeys(branches)) if len(branches) > 1 else err.get("msg", "invalid value")
    code = "invalid_value" if kind.startswith(("less_than", "greater_than")) else "invalid_type"  # (a range: logprobs)
    return APIError(400, f"invalid value for field '{field}': {msg}", param=param, code=code)


def _is_type_tag(part: str) -> bool:
    return (part in ("str", "int", "float", "bool", "none") or "[" in part
            or part.startswith(("constrained-", "function-")))


def response_body(chat: bool, rid: str, created: int, model: str,
                  choices: list[tuple[str | None, str, list[int], dict | None]], usage: Usage,
                  reasoning: list[str | None] | None = None, tool_calls: list[list[dict]] | None = None,
                  stop_reasons: list[int | str | None] | None = None) -> dict:
    """`choices`: (text, finish_reason, token_ids, logprobs) per prompt, in the prompts' order (their `index`);
    `reasoning`: a chat's per choice with --reasoning-parser (None: the message has no such key); `tool_calls`:
    a chat's per choice (the key only where there are some); `stop_reasons`: vLLM's per choice (None: all null)."""
    common = dict(id=rid, created=created, model=model, usage=usage)
    reasons = stop_reasons or [None] * len(choices)
    if chat:
        body = ChatCompletionResponse(choices=[
            ChatChoice(index=i, message=AssistantMessage(content=text, reasoning_content=reasoning and reasoning[i],
                                                         tool_calls=tool_calls and tool_calls[i] or None),
                       finish_reason=finish, stop_reason=reasons[i], token_ids=ids, logprobs=lps)
            for i, (text, finish, ids, lps) in enumerate(choices)], **common).model_dump()
        for choice in body["choices"]:
            message = choice["message"]
            if reasoning is None:
                del message["reasoning_content"]
            if message["tool_calls"] is None:
                del message["tool_calls"]
        return body
    return CompletionResponse(choices=[
        CompletionChoice(index=i, text=text, finish_reason=finish, stop_reason=reasons[i], token_ids=ids, logprobs=lps)
        for i, (text, finish, ids, lps) in enumerate(choices)], **common).model_dump()


def usage_chunk(chat: bool, rid: str, created: int, model: str, usage: Usage) -> dict:
    """The chunk after the last one when stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage.model_dump()}


def stream_chunk(chat: bool, rid: str, created: int, model: str, text: str, token_ids: list[int],
                 finish_reason: str | None, first: bool, usage: Usage | None | Literal[False], index: int = 0,
                 logprobs: dict | None = None, reasoning: str = "", tool_calls: list[dict] | None = None,
                 stop_reason: int | str | None = None) -> dict:
    """One SSE chunk of choice `index`; `usage` False leaves the key out (no stream_options.include_usage),
    None is the null that OpenAI puts in every choice chunk (the usage follows in `usage_chunk`); `logprobs`:
    the chunk's tokens' (scheduler/logprobs.py); `reasoning`: a chat's thinking text of the chunk, sent as
    the delta's reasoning_content (vLLM's; its `content` then only when the chunk has some); `tool_calls`: the
    chunk's tool call deltas (scheduler/chat_answer.py), likewise. `stop_reason`: vLLM's, its choice's once it
    ended: a completion's every chunk has the key, a chat's only the one with its finish_reason (vLLM's chat
    chunks leave unset fields out)."""
    choice: dict = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
    if not chat or finish_reason is not None:
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = token_ids
    if chat:
        delta = {"role": "assistant"} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text or not (reasoning or tool_calls):
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = text
    chunk = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
             "model": model, "choices": [choice]}
    if usage is not False:
        chunk["usage"] = None if usage is None else usage.model_dump()
    return chunk


def _loads(body: bytes) -> Any:
    """json.loads, with a number no JSON encoder sends back a 400 naming where it is: NaN and Infinity (Python's
    json reads them; RFC 8259 has neither) and one past a double's range (1e400: Python reads inf). A field that
    takes any JSON (a tool's parameters, a schema) carried one into a Response no encoder could write: a 500
    after the answer was generated, kept, and a stream's events carrying the bare token (regressions)."""
    nonfinite: list[str] = []

    def number(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            nonfinite.append(text)
        return value

    obj = json.loads(body, parse_constant=number, parse_float=number)
    if nonfinite:
        where = _nonfinite_at(obj) or "body"
        raise APIError(400, f"{where!r} must be a finite number, got {nonfinite[0][:40]} (JSON has no NaN or "
                            f"Infinity, and a number must fit a double)", param=where, code="invalid_value")
    return obj


def _nonfinite_at(x: Any, path: str = "") -> str | None:
    """The dotted path of the first non-finite float in `x` (None: none)."""
    if isinstance(x, float):
        return None if math.isfinite(x) else path
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for key, value in items:
        if (found := _nonfinite_at(value, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


async def read_json_body(request, max_bytes: int, empty_ok: bool = False) -> dict:
    """The body of a starlette request as a JSON object; 413 past `max_bytes` (checked from
    Content-Length before reading and again while reading), 400 when it is not a JSON object or not sent as JSON
    (`Content-Type: application/json`, or a +json type: as FastAPI's bodies are, so that a browser's simple request,
    text/plain or a form, which no CORS preflight guards, cannot run generations or reset the cache from another
    site). empty_ok: an empty body is {}."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":  # (no body is decompressed: a gzip one was a 400 "not valid JSON", regression)
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                       code="unsupported_content_encoding", type="invalid_request_error")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, "invalid Content-Length header", code="invalid_header")
        if int(length) > max_bytes:
            raise APIError(413, f"request body of {int(length)} bytes exceeds the limit of {max_bytes} bytes "
                                f"(--max-body-bytes)", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes (--max-body-bytes)",
                           code="body_too_large")
    if empty_ok and not body:
        return {}
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(400, f"the body must be sent as JSON (Content-Type: application/json), got "
                            f"{media or 'no Content-Type'}", code="invalid_content_type")
    try:
        obj = _loads(bytes(body))
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    if (depth := _depth_past(obj, MAX_JSON_DEPTH)) is not None:  # (regression: a 500, RecursionError, where a
        # field nested deep was walked or written: a tool's parameters, a guided_json)
        raise APIError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels (at '{depth}')",
                       param=depth.partition(".")[0], code="invalid_json")
    return obj


def _depth_past(obj: Any, limit: int) -> str | None:
    """The dotted path of the first object or array nested deeper than `limit` (None: none), walked without
    recursion, over containers only (a prompt's token ids are not visited one by one)."""
    stack: list[tuple[Any, int, tuple | None]] = [(obj, 0, None)]  # (container, its depth, (key, parent's trail))
    while stack:
        value, depth, trail = stack.pop()
        if depth > limit:
            keys = []
            while trail is not None:
                key, trail = trail
                keys.append(str(key))
            return ".".join(reversed(keys))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend((v, depth + 1, (k, trail)) for k, v in items if isinstance(v, (dict, list)))
    return None


def jsonable(x: Any) -> Any:
    """A JSON-safe copy: non-finite floats -> null, tuples/sets -> lists, enums/scalars unwrapped."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, enum.Enum):
        return jsonable(x.value)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return jsonable(dataclasses.asdict(x))
    if callable(getattr(x, "item", None)):
        with contextlib.suppress(Exception):
            return jsonable(x.item())
    return str(x)

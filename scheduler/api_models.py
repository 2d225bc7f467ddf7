"""Request / response bodies of the OpenAI-compatible API, and the one error shape every failure uses:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "..."}}

Request models are strict: unknown fields and wrong JSON types are errors (400), never coerced.
Token ids are what this engine speaks: `stop` / `stop_token_ids` are token ids, and every choice
carries the generated `token_ids` next to the text.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

Float = Annotated[float, Field(strict=True)]  # accepts JSON numbers (ints too), never strings
TokenIds = list[StrictInt]


class APIError(Exception):
    """An error answered to the client as the JSON error body with `status` (a 4xx unless the
    engine itself failed)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _DEFAULT_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_DEFAULT_TYPES = {404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                  503: "service_unavailable"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _SamplingFields(_Strict):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    seed: StrictInt | None = None
    stop: StrictInt | TokenIds | StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: StrictStr | None = None
    # accepted for client compatibility; only their neutral values are supported
    logprobs: StrictInt | StrictBool | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None

    def stop_ids(self) -> tuple[int, ...]:
        stop: list[int] = []
        if isinstance(self.stop, str) or (isinstance(self.stop, list) and any(isinstance(s, str) for s in self.stop)):
            raise APIError(400, "'stop' takes token ids (an integer or a list of integers); stop strings are "
                                "not supported", param="stop", code="unsupported_value")
        if isinstance(self.stop, int):
            stop.append(self.stop)
        elif self.stop:
            stop.extend(self.stop)
        stop.extend(self.stop_token_ids or ())
        for t in stop:
            if t < 0:
                raise APIError(400, f"stop token id {t} must be >= 0", param="stop", code="invalid_value")
        return tuple(dict.fromkeys(stop))

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"'n' must be 1 (got {self.n}); this server generates one choice per request",
                           param="n", code="unsupported_value")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "'logprobs' is not supported", param="logprobs", code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise APIError(400, f"'{name}' is not supported (only 0)", param=name, code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options",
                           code="invalid_value")


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | TokenIds
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError(400, "'echo' is not supported", param="echo", code="unsupported_value")
        if self.best_of not in (None, 1):
            raise APIError(400, "'best_of' must be 1", param="best_of", code="unsupported_value")
        if self.suffix:
            raise APIError(400, "'suffix' is not supported", param="suffix", code="unsupported_value")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None


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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None
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
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None
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
    # drop union-branch tags such as 'str' / 'list[int]' / 'int' that pydantic inserts in the path
    path = [str(p) for p in loc if isinstance(p, int) or not _is_type_tag(str(p))]
    field = ".".join(path) or "body"
    param = str(path[0]) if path else None
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field '{field}' (extra fields are not permitted)", param=param,
                        code="unknown_field")
    if kind == "missing":
        return APIError(400, f"missing required field '{field}'", param=param, code="missing_field")
    branches = [e.get("msg", "") for e in errors if e.get("loc", ())[:1] == err.get("loc", ())[:1]]
    msg = "; or ".join(dict.fromkeys(branches)) if len(branches) > 1 else err.get("msg", "invalid value")
    return APIError(400, f"invalid value for field '{field}': {msg}", param=param, code="invalid_type")


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "none") or "[" in part or part.startswith(("constrained-", "function-"))

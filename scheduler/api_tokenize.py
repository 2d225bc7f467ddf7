"""vLLM's /tokenize and /detokenize (routed by scheduler/server.py): text <-> token ids with the server's
own tokenizer, for clients that count tokens (lm-eval, guidance, benchmark clients).

    POST /tokenize    {"model"?, "prompt": str, "add_special_tokens"?: true, "return_token_strs"?: false}
                      or a chat: {"model"?, "messages": [...], "add_generation_prompt"?: true,
                      "continue_final_message"?: false, "add_special_tokens"?: false,
                      "chat_template_kwargs"?: {...}, "tools"?: [...], "return_token_strs"?}
                      -> {"count", "max_model_len", "tokens", "token_strs": [str] or null}
    POST /detokenize  {"model"?, "tokens": [int]} -> {"prompt": str}

A prompt is encoded as /v1/completions encodes a text prompt, messages rendered as /v1/chat/completions
renders them (the tokenizer's apply_chat_template), so `count` is the usage.prompt_tokens those report.
Bodies are strict as /v1/completions' (unknown fields: 400); a `model` must name the served one (404).
`max_model_len` is /v1/models' (Engine.max_kv_tokens): the prompt + generated tokens one request may hold,
what a client plans a request with (a prompt alone is also held to --max-prompt-tokens, /hicache/status's
limits.max_prompt_tokens). Neither endpoint touches the engine: no generation slot (--max-concurrent-requests),
no completion metrics, no length limit (only --max-body-bytes bounds a text to count)."""
from __future__ import annotations

from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictBool, StrictStr, ValidationError
from starlette.requests import ClientDisconnect

from scheduler.api_inputs import chat_ids, check_model, check_texts, check_unicode
from scheduler.api_models import (APIError, ChatMessage, ChatTemplateFields, TokenIds, _Strict, read_json_body,
                                  validation_error)
from scheduler.api_tools import ToolDefinition


class TokenizeCompletionRequest(_Strict):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(_Strict, ChatTemplateFields):
    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None  # (rendered as a chat completion renders them)
    return_token_strs: StrictBool | None = False


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: TokenIds


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


def chat_unavailable(tokenizer, model_name: str, body: dict) -> APIError | None:
    """The 400 a chat gets (/v1/chat/completions, /tokenize's chat form) when the tokenizer has no chat template
    and the request (`body`) brings none of its own (api_inputs.request_template: refused or rendered there)."""
    kwargs = body.get("chat_template_kwargs")
    own = body.get("chat_template") is not None or isinstance(kwargs, dict) and kwargs.get("chat_template") is not None
    if getattr(tokenizer, "chat_template", None) is not None or own and tokenizer is not None:
        return None
    reason = getattr(tokenizer, "no_chat_reason", "the model has no tokenizer")
    return APIError(400, f"no chat template is available for model {model_name!r} ({reason}); use "
                         f"/v1/completions with a prompt of text or token ids (or a request's own chat_template, on a "
                         f"server started with --trust-request-chat-template)", code="chat_template_unavailable")


async def tokenize(request, st) -> dict | Response:
    body = await _read_body(request, st)
    if body is None:
        return Response(status_code=499)
    chat = "messages" in body
    if not chat and "prompt" not in body:
        raise APIError(400, "missing required field 'prompt' (the text to tokenize; or 'messages', a chat)",
                       param="prompt", code="missing_field")
    req = _parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    check_model(req.model, st.served_names, st.model_name)
    tokenizer = st.tokenizer
    if chat:
        ids = _chat_ids(req, tokenizer, st.model_name, st.limits)
    else:
        _no_tokenizer(tokenizer, "text cannot be tokenized", "prompt")
        check_texts([req.prompt], "prompt")
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    answer = TokenizeResponse.model_construct(count=len(ids), max_model_len=st.engine.max_kv_tokens, tokens=ids,
                                              token_strs=tokenizer.token_strs(ids) if req.return_token_strs else None)
    # (written as it is: FastAPI's encoder walked a 2 MB text's 2 million ids for 1.5 s on the loop)
    return Response(answer.model_dump_json(), media_type="application/json")


async def detokenize(request, st) -> dict | Response:
    body = await _read_body(request, st)
    if body is None:
        return Response(status_code=499)
    req = _parse(DetokenizeRequest, body)
    check_model(req.model, st.served_names, st.model_name)
    vocab_size = st.engine.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="tokens",
                       code="invalid_token_id")
    _no_tokenizer(st.tokenizer, "token ids cannot be turned into text", "tokens")
    # special tokens kept (vLLM's decode): the text of what was tokenized, BOS and all
    return {"prompt": st.tokenizer.decode(req.tokens, skip_special_tokens=False)}


async def _read_body(request, st) -> dict | None:
    """The JSON body (api_models.read_json_body's limits); None when the client left while it was read."""
    try:
        return await read_json_body(request, st.limits.max_body_bytes)
    except ClientDisconnect:
        return None


def _parse(model: type[_Strict], body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _no_tokenizer(tokenizer, what: str, param: str) -> None:
    if tokenizer is None:
        raise APIError(400, f"this model has no tokenizer (no tokenizer.json), so {what}", param=param,
                       code="tokenizer_unavailable")


def _chat_ids(req: TokenizeChatRequest, tokenizer, model_name: str, limits) -> list[int]:
    """The messages rendered by the chat template /v1/chat/completions uses, with the request's options (and the
    server's: `limits`, its ServerLimits)."""
    if err := chat_unavailable(tokenizer, model_name, req.model_dump()):
        raise err
    check_unicode(req, "messages")
    return chat_ids(req, tokenizer, limits.trust_request_chat_template, limits.chat_template_content_format)

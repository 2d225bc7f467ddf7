"""An HTTP body turned into engine input (scheduler/server.py): `parse_prompts` validates a decoded JSON
body (its request model, limits, each prompt's token ids, SamplingParams), `choice_params` derives choice j's
sampling parameters, `echo_text` the prompt text a completion with `echo` sends first. vLLM's
`truncate_prompt_tokens` keeps each prompt's last tokens (scheduler/prompt_truncation.py), before its limits.

A completion's `echo` (vLLM's semantics): the prompt's text ahead of each choice's own; with `logprobs: k`
the engine computes the prompt's logprobs too (SamplingParams.prompt_logprobs = k: the prompt's tokens'
entries come first, scheduler/logprobs.py); `max_tokens: 0` is allowed with echo only (the prefill alone: the
prompt is the whole answer, finish_reason "length"). vLLM's `prompt_logprobs: k` asks the engine for them too
(scheduler/prompt_logprobs_api.py), for the larger k where the echo asks as well."""
from __future__ import annotations

import dataclasses
import functools
import json

from pydantic import ValidationError

from scheduler import prompt_logprobs_api
from scheduler.api_guided import GuidedFieldError
from scheduler.api_models import (APIError, ChatCompletionRequest, ChatTemplateFields, CompletionRequest,
                                  _SamplingFields, validation_error)
from scheduler.generation_defaults import GenerationDefaults, range_problem
from scheduler.openai_fields import template_variables
from scheduler.prompt_truncation import PARAM as TRUNCATION, kept_tokens
from scheduler.request import SEED_MAX, SEED_MIN, RequestError, SamplingParams
from scheduler.tokenizer import TEMPLATE_VARIABLES, TokenizerError


def parse_prompts(body: dict, chat: bool, *, tokenizer, served_names: set[str], model_name: str, vocab_size: int,
                  prompt_limit: int, max_tokens_limit: int, default_max_tokens: int = 16,
                  context_tokens: int | None = None, sampling_defaults: GenerationDefaults = GenerationDefaults(),
                  auto_tools: bool = False, trust_templates: bool = False, content_format: str = "auto"
                  ) -> tuple[CompletionRequest | ChatCompletionRequest, list[list[int]], SamplingParams]:
    """Validate a decoded JSON body: (the request model, each prompt's token ids in order: one, or a
    completion's batch, sampling parameters). Raises APIError (400 / 404) naming the field or limit (a
    batch's prompt by its position: "prompt.2"). Without max_tokens a completion gets `default_max_tokens`
    (OpenAI's legacy default, 16) and a chat what is left of `context_tokens` (the tokens a request can
    hold; OpenAI's chat has no default), each within max_tokens_limit. `sampling_defaults`: for the sampling
    fields the request leaves out or sets to null (scheduler/generation_defaults.py; none given: OpenAI's).
    auto_tools: the server reads tool calls out of answers (a chat's tool_choice "auto" is served);
    trust_templates: a chat's own `chat_template` is rendered (--trust-request-chat-template), not refused;
    content_format: --chat-template-content-format's (`chat_ids`)."""
    try:
        request_model = ChatCompletionRequest if chat else CompletionRequest
        req = request_model.model_validate(body, context={"vocab_size": vocab_size})  # (logit_bias' token ids)
    except ValidationError as exc:
        raise validation_error(exc) from None
    req.check_unsupported()
    if chat:
        try:
            req.check_tools(auto_tools)
        except GuidedFieldError as exc:  # (scheduler/api_tools.py's ToolFieldError)
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
        if req.tool_mode() == "auto":  # (vLLM's hermes parser's adjust_request: some tokenizers mark <tool_call> and
            # </tool_call> special, and a decode that skipped them hid every call from the parser; regression)
            req.skip_special_tokens = False
    check_model(req.model, served_names, model_name)
    param = "messages" if chat else "prompt"
    check_unicode(req, param)
    if req.stop_strings() and tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so stop strings cannot be matched; send 'stop' as "
                            "token ids", param="stop", code="invalid_value")
    try:  # (vLLM's truncate_prompt_tokens: scheduler/prompt_truncation.py)
        keep = kept_tokens(req, chat, prompt_limit=prompt_limit, context_tokens=context_tokens,
                           default_max_tokens=default_max_tokens, max_tokens_limit=max_tokens_limit)
    except ValueError as exc:
        raise APIError(400, str(exc), param=TRUNCATION, code="invalid_value") from None
    prompts = [chat_ids(req, tokenizer, trust_templates, content_format)] if chat else prompt_list(req)  # (rendered)
    ids = []
    for i, prompt in enumerate(prompts):
        try:
            ids.append(_prompt_ids(prompt, req.add_special_tokens, param, tokenizer, vocab_size, prompt_limit, keep))
        except APIError as exc:  # the whole request fails, naming the batch's prompt
            if len(prompts) > 1:
                exc.param, exc.message = f"{param}.{i}", f"prompt {i} of the batch: {exc.message}"
            raise
    if chat and context_tokens is not None:  # prompt + max_tokens - 1 tokens of K/V
        default_max_tokens = max(1, context_tokens + 1 - len(ids[0]))
    params = _sampling(sampling_defaults.fill(req), max_tokens_limit, default_max_tokens, tokenizer, vocab_size)
    prompt_logprobs_api.check_fan_out(req, [len(i) for i in ids], vocab_size)
    return req, ids, params


def prompt_list(req: CompletionRequest) -> list[str | list[int]]:
    """A completion's prompts: a list of prompts (OpenAI's batch; ["text"] or [[ids]] is one prompt), or one."""
    if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
        return list(req.prompt)
    return [req.prompt]


def echo_text(req: CompletionRequest | ChatCompletionRequest, index: int, ids: list[int], tokenizer) -> str | None:
    """The text a completion with `echo` sends ahead of choice text of prompt `index` (ids: its token ids, as
    the engine has them): the prompt as given, or its ids decoded ("" without a tokenizer) as the choice's text
    is, special tokens kept with skip_special_tokens false (regression: the prompt's were dropped, the
    generated ones kept); a prompt truncate_prompt_tokens cut, its kept ids decoded (vLLM echoes the whole
    text: here the echo, its logprobs' pieces and text offsets and usage.prompt_tokens agree), a text prompt's
    with its special tokens, which the client wrote in it (regression: "a<s>b" cut to 2 echoed "b"); None
    without echo (a chat has none)."""
    if not getattr(req, "echo", False):
        return None
    prompt = prompt_list(req)[index]
    kept_whole = req.truncate_prompt_tokens is None or isinstance(prompt, str) and len(
        tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)) == len(ids)
    if isinstance(prompt, str) and kept_whole:
        return prompt
    skip = req.skip_special_tokens and not isinstance(prompt, str)
    return tokenizer.decode(ids, skip_special_tokens=skip) if tokenizer is not None else ""


def _prompt_ids(prompt: str | list[int], add_special_tokens: bool, param: str, tokenizer, vocab_size: int,
                prompt_limit: int, keep: int | None = None) -> list[int]:
    """One prompt's token ids (a chat's: its rendered messages' ids), its last `keep` (None: all), checked against
    the limits."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as a list of token ids",
                           param=param, code="invalid_value")
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        ids = list(prompt)
    if keep is not None:
        ids = ids[-keep:]
    if not ids:
        raise APIError(400, "the prompt is empty", param=param, code="invalid_value")
    if len(ids) > prompt_limit:
        raise APIError(400, f"prompt of {len(ids)} tokens exceeds the limit of {prompt_limit} tokens "
                            f"(--max-prompt-tokens, within the L1 pool and the model's positions)", param=param,
                       code="prompt_too_long")
    for t in ids:
        if not 0 <= t < vocab_size:
            raise APIError(400, f"token id {t} is outside the vocabulary [0, {vocab_size})", param=param,
                           code="invalid_token_id")
    return ids


def chat_ids(req: ChatTemplateFields, tokenizer, trust_templates: bool = False, content_format: str = "auto"
             ) -> list[int]:
    """A chat's messages (`req.messages`) rendered by the chat template with the request's options (vLLM's:
    both `continue_final_message` and `add_generation_prompt` is a 400; `chat_template_kwargs` may set no
    variable the server sets itself; a chat's `reasoning_effort` goes over them, with enable_thinking, as vLLM
    sets it: scheduler/openai_fields.py), encoded. A template's own refusal (raise_exception) is a 400, naming
    'chat_template_kwargs' or 'reasoning_effort' where the messages render without it. A request's own template
    (`request_template`) renders in place of the server's where `trust_templates` (--trust-request-chat-template).
    Each message's content reaches the template in `content_format` (vLLM's --chat-template-content-format: "auto",
    the one the template reads, scheduler/chat_template.py); the request's `tools`, [] too, as they are (vLLM's)."""
    if req.continue_final_message and req.add_generation_prompt:  # (vLLM's 400)
        raise APIError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true (the "
                            "default of 'add_generation_prompt' is true)", param="continue_final_message",
                       code="invalid_value")
    template = request_template(req, trust_templates, tokenizer)
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "chat_template"}
    if taken := [k for k in kwargs if k in (*TEMPLATE_VARIABLES, "continue_final_message")]:
        field = "; use the request's field" if taken[0] in ChatTemplateFields.model_fields else ""
        raise APIError(400, f"'chat_template_kwargs' may not set {taken[0]!r} (the server sets it{field})",
                       param="chat_template_kwargs", code="invalid_value")
    check_texts([json.dumps(kwargs, ensure_ascii=False)], "chat_template_kwargs")
    # (regression: `tools: []` reached the template as None; vLLM and transformers pass [], and a template that
    # asks `tools is not none`, Llama 3.1's, renders its tool-calling preamble for it)
    tools = None if getattr(req, "tools", None) is None else [t.model_dump(exclude_none=True) for t in req.tools]
    if content_format == "auto":  # (a tokenizer of a library user's own that cannot tell: "string", as before)
        reader = getattr(tokenizer, "content_format", None)
        content_format = reader(template, tools is not None) if reader is not None else "string"
    messages = [m.as_template_dict(content_format) for m in req.messages]
    render = functools.partial(tokenizer.apply_chat_template, messages,
                               tools=tools, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               add_special_tokens=req.add_special_tokens, template=template)
    variables = template_variables(req, kwargs)
    try:
        return render(template_kwargs=variables)
    except TokenizerError:  # the server's tokenizer, not the request: a 500, counted failed
        raise
    except Exception as exc:  # a template may reject a conversation (raise_exception), or fail on a kwarg's value
        failed = exc
    if variables and _renders(render, {}):  # (regression: a kwarg the template failed on was blamed on 'messages')
        param = "reasoning_effort" if variables != kwargs and _renders(render, kwargs) else "chat_template_kwargs"
        raise APIError(400, f"the chat template failed on '{param}': {failed}", param=param, code="invalid_value")
    raise APIError(400, f"the chat template rejected the messages: {failed}", param="messages",
                   code="invalid_messages")


def request_template(req: ChatTemplateFields, trusted: bool, tokenizer):
    """A request's own chat template, compiled (None: the server's): vLLM's `chat_template` field, or the
    chat_template_kwargs key transformers takes for it (the two: the same text). Refused, with vLLM's message,
    unless the server trusts requests' templates (a template is code the server runs); one that does not compile:
    a 400 naming the field."""
    kwargs_template = (req.chat_template_kwargs or {}).get("chat_template")
    given = {field: text for field, text in (("chat_template", req.chat_template),
                                             ("chat_template_kwargs", kwargs_template)) if text is not None}
    if not given:
        return None
    param, text = next(iter(given.items()))
    if not trusted:
        raise APIError(400, "Chat template is passed with request, but --trust-request-chat-template is not set. "
                            "Refused request with untrusted chat template.", param=param,
                       code="untrusted_chat_template")
    if not isinstance(given.get("chat_template_kwargs", text), str) or len(set(given.values())) > 1:
        raise APIError(400, "'chat_template_kwargs.chat_template' must be a string, the same as 'chat_template' "
                            "where both are given", param="chat_template_kwargs", code="invalid_value")
    check_texts([text], param)
    try:
        return tokenizer.request_template(text)
    except ValueError as exc:
        raise APIError(400, f"the request's chat template: {exc}", param=param, code="invalid_value") from None


def _renders(render, variables: dict) -> bool:
    """Whether the messages render with only these template variables (a failure's second look: what it was on)."""
    try:
        render(template_kwargs=variables)
    except Exception:
        return False
    return True


def check_unicode(req, param: str) -> None:
    """Text a tokenizer can take: JSON allows lone surrogates ("\\ud800"), which UTF-8 cannot encode
    (a 500 from the tokenizer, or a misleading 'the chat template rejected the messages'). A chat's (a
    completion's, /tokenize's): its messages as the template gets them, and its tools."""
    if hasattr(req, "messages"):
        texts = [json.dumps(m.as_template_dict(), ensure_ascii=False) for m in req.messages]
        # (a tool's surrogate was blamed on 'messages')
        check_texts([json.dumps(t.model_dump(), ensure_ascii=False) for t in getattr(req, "tools", None) or ()], "tools")
    else:
        texts = [req.prompt] if isinstance(req.prompt, str) else [p for p in req.prompt if isinstance(p, str)]
    check_texts(texts, param)


def check_texts(texts: list[str], param: str) -> None:
    """Each text UTF-8 can encode (a 400 naming `param` otherwise)."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeError as exc:
            raise APIError(400, f"the {param} is not valid Unicode text: {exc}", param=param,
                           code="invalid_value") from None


def check_model(model: str | None, served_names, model_name: str) -> None:
    """A request's `model`, when given, names the served model (a 404 otherwise)."""
    if model not in (None, "") and model not in served_names:
        raise model_not_found(model, served_names, model_name)


def model_not_found(model: str, served_names, model_name: str) -> APIError:
    """The 404 for a model not served, naming every name the served one answers to (regression: with
    --served-model-name foo bar it named 'foo' alone, where 'bar' was served too)."""
    others = sorted(set(served_names) - {model_name})
    also = f" (also named {', '.join(map(repr, others))})" if others else ""
    return APIError(404, f"model {model!r} is not served here; this server serves {model_name!r}{also}",
                    param="model", code="model_not_found")


def _sampling(req: _SamplingFields, max_tokens_limit: int, default_max_tokens: int, tokenizer,
              vocab_size: int) -> SamplingParams:
    name, max_tokens = "max_tokens", req.max_tokens
    if getattr(req, "max_completion_tokens", None) is not None:
        name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    max_tokens = min(default_max_tokens, max_tokens_limit) if max_tokens is None else max_tokens
    echo = bool(getattr(req, "echo", False))
    if max_tokens < (0 if echo else 1):  # (0: vLLM's prefill alone, the prompt echoed with its logprobs)
        with_echo = " (0 only with 'echo': true)" if hasattr(req, "echo") else ""  # (a chat has no echo)
        raise APIError(400, f"'{name}' must be >= 1{with_echo}, got {max_tokens}", param=name, code="invalid_value")
    if max_tokens > max_tokens_limit:
        raise APIError(400, f"'{name}' of {max_tokens} exceeds the limit of {max_tokens_limit} "
                            f"(--max-tokens-limit)", param=name, code="max_tokens_too_large")
    for field in ("temperature", "top_p"):
        if problem := range_problem(field, getattr(req, field)):
            raise APIError(400, f"'{field}' {problem}", param=field, code="invalid_value")
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise APIError(400, f"'seed' must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}], got {req.seed}",
                       param="seed", code="invalid_value")
    try:
        guided = req.guided()[1]  # (scheduler/api_guided.py)
    except GuidedFieldError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    logprobs = req.logprob_count()
    prompt_logprobs = logprobs if echo else None  # (vLLM's: an echoed prompt's where the tokens' are asked)
    if echo and max_tokens == 0 and logprobs is None:
        prompt_logprobs = 0  # the engine runs a prefill alone for prompt logprobs only (these left unshown)
    try:  # vLLM's prompt_logprobs (scheduler/prompt_logprobs_api.py): with an echo's, the larger k of the two
        asked = prompt_logprobs_api.asked_count(req, vocab_size)
    except ValueError as exc:
        raise APIError(400, str(exc), param=prompt_logprobs_api.PARAM, code="invalid_value") from None
    if asked is not None:
        prompt_logprobs = asked if prompt_logprobs is None else max(asked, prompt_logprobs)
    # no temperature: OpenAI's default of 1 (it was greedy here, so a seed or top_p alone changed nothing)
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p,
                          seed=None if req.seed == -1 else req.seed,  # (vLLM's: -1 is no seed, a random answer)
                          stop_token_ids=req.stop_ids(), ignore_eos=req.ignore_eos, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs, guided=guided, priority=req.priority,
                          cache_salt=req.cache_salt,
                          **req.penalty_params(max_tokens),
                          **req.sampler_params(),
                          **req.ban_params(tokenizer, vocab_size))  # (bad_words tokenized: scheduler/ban_fields.py)


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j's sampling parameters. With a seed, seed + j (vLLM's derivation), wrapped within a seed's 64 bits
    (the generator reads a seed's two's-complement bits, so the wrap keeps the stream): the n choices differ, a
    repeat of the request repeats them, and choice 0 is the n=1 request's. Without a seed each choice draws on
    its own; greedy choices are all the greedy text (vLLM refuses n > 1 with temperature 0; OpenAI's are alike)."""
    if params.seed is None or j == 0:
        return params
    seed = params.seed + j
    return dataclasses.replace(params, seed=seed - (1 << 64) if seed > SEED_MAX else seed)


def named_refusal(exc: RequestError, api_req) -> RequestError:
    """The engine's refusal of a request, by the field the client sent: a grammar by the field that asked for it (a
    tool_choice's is its tools' parameters schema: regression, "guided json_schema does not compile" was blamed on
    tool_choice), the max tokens by max_completion_tokens where a chat sent that (regression: told max_tokens)."""
    if exc.param == "guided":
        field = api_req.guided()[0]
        if field != "tool_choice":
            exc.param = field
        else:  # (scheduler/api_tools.py ToolFields.tool_spec)
            exc = RequestError(str(exc).replace("guided json_schema", "the tools' parameters schema", 1), "tools")
    if exc.param == "max_tokens" and getattr(api_req, "max_completion_tokens", None) is not None:
        exc = RequestError(str(exc).replace("max_tokens (", "max_completion_tokens ("), "max_completion_tokens")
    return exc

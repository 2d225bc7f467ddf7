"""OpenAI's request fields that SDKs and frameworks (openai-python, LangChain, LiteLLM, the Agents SDK) send and
this server does not otherwise serve, mixed into api_models' request models (each was an "unknown field" 400):

* Fields that change nothing about the answer, on /v1/completions and /v1/chat/completions: accepted, their
  JSON type validated, ignored. `metadata` (an object of strings within OpenAI's bounds), `store` (true too, as
  vLLM ignores it: nothing is stored either way, and nothing here reads stored completions back), `service_tier`
  ("auto", "default" or null: another tier is an 'unsupported_value' 400), `prompt_cache_key`,
  `prompt_cache_retention`, `prompt_cache_options` (OpenAI's cache routing and lifetime hints: the prefix
  cache finds shared prefixes itself), `safety_identifier`.
* `reasoning_effort` (a chat's; vLLM's values: OpenAI's and DeepSeek V4's "max") is a chat template variable,
  as vLLM passes it: set over chat_template_kwargs' own `reasoning_effort`, with `enable_thinking` (true,
  false for "none") unless chat_template_kwargs set that (`template_variables`). A template that names neither
  renders as without them.
* A chat's fields that would change the answer (`verbosity`, `modalities`, `audio`, `prediction`,
  `web_search_options`, `moderation`, the deprecated `functions` and `function_call`): their neutral values
  only, through _SamplingFields.check_unsupported's NEUTRAL (any other value an 'unsupported_value' 400 naming
  the field), their JSON types validated as OpenAI's.

OpenAI's Completions defines none of the chat's fields, so they stay unknown there. The mixins go ahead of
_SamplingFields in a request model's bases: their NEUTRAL is then the one check_unsupported reads.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # (vLLM's Literal)
# OpenAI's Metadata: "Set of 16 key-value pairs ... Keys ... maximum length of 64 characters. Values ... 512"
# (regression: past them a Response echoed and kept them)
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
Metadata = Annotated[dict[Annotated[StrictStr, Field(max_length=METADATA_KEY_CHARS)],
                          Annotated[StrictStr, Field(max_length=METADATA_VALUE_CHARS)]],
                     Field(max_length=METADATA_PAIRS)]


class PromptCacheOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class OpenAIMetadataFields(BaseModel):
    """The fields that change nothing (both endpoints)."""
    metadata: Metadata | None = None
    store: StrictBool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    # OpenAI's routing hint for its prefix cache: not an isolation boundary (vLLM's cache_salt is: a prefix is
    # shared only among requests of one salt), so it changes nothing here
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: StrictStr | None = None

    # (name, the values served): another tier would promise a latency or a price this server does not keep
    NEUTRAL: ClassVar[tuple[tuple[str, tuple], ...]] = (("service_tier", (None, "auto", "default")),)


class OpenAIChatFields(OpenAIMetadataFields):
    """A chat's: the ones above, reasoning_effort, and those served at their neutral values only."""
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # (OpenAI's default: "medium")
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[StrictStr, Any] | None = None  # (an audio answer's voice and format)
    prediction: dict[StrictStr, Any] | None = None  # (a predicted output: OpenAI bills and counts its tokens)
    web_search_options: dict[StrictStr, Any] | None = None  # ({} turns the search on)
    moderation: dict[StrictStr, Any] | None = None
    functions: list[dict[StrictStr, Any]] | None = None
    function_call: StrictStr | dict[StrictStr, Any] | None = None

    NEUTRAL: ClassVar[tuple[tuple[str, tuple], ...]] = OpenAIMetadataFields.NEUTRAL + (
        ("verbosity", (None, "medium")), ("modalities", (None, ["text"])), ("audio", (None,)),
        ("prediction", (None,)), ("web_search_options", (None,)), ("moderation", (None,)),
        ("functions", (None, [])), ("function_call", (None, "none", "auto")))


def template_variables(req, kwargs: dict) -> dict:
    """The chat template's variables beyond the server's own: the request's chat_template_kwargs (`kwargs`), and
    its reasoning_effort as vLLM merges it (ChatCompletionRequest.build_chat_params): over kwargs' own, with
    enable_thinking (false for "none") unless kwargs set it. `kwargs` is left as it is."""
    effort = getattr(req, "reasoning_effort", None)  # (/tokenize's chat form has none)
    if effort is None:
        return kwargs
    thinking = {} if "enable_thinking" in kwargs else {"enable_thinking": effort != "none"}
    return {**kwargs, "reasoning_effort": effort, **thinking}

"""OpenAI's request fields that SDKs and frameworks (openai-python, LangChain, LiteLLM, the Agents SDK) put in chat
and completion bodies, each an "unknown field" 400 before (scheduler/openai_fields.py): the ones that change
nothing (metadata, store, service_tier "auto"/"default", prompt_cache_key, prompt_cache_retention,
prompt_cache_options, safety_identifier) are served and the answer is the one without them; `reasoning_effort`
reaches the chat template as vLLM passes it (with enable_thinking); the ones that would change the answer
(verbosity, modalities, audio, prediction, web_search_options, moderation, functions, function_call) are served
at their neutral values only, any other value an 'unsupported_value' 400 naming the field. A field of neither
kind is still an unknown field. The HTTP server on the CPU (tiny preset, a byte-level tokenizer: one token per
byte of ASCII text) with a template that writes the two variables out."""
from __future__ import annotations

import json

import openai
import pytest

from scheduler.api_inputs import chat_ids
from scheduler.api_models import ChatCompletionRequest
from server_fixtures import byte_level_server, ok, post, tiny_config

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
            "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}"
            "{% if enable_thinking is defined %}[thinking={{ enable_thinking }}]{% endif %}")
HI = [{"role": "user", "content": "hi"}]
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
BASE = {CHAT: {"messages": HI, "max_tokens": 4, "temperature": 0},
        CMPL: {"prompt": "hello", "max_tokens": 4, "temperature": 0}}


def _where(path: str) -> str:
    return "chat" if path == CHAT else "cmpl"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=16), chat_template=TEMPLATE) as s:
        yield s


def _answer(body: dict) -> tuple:
    return [(c["token_ids"], c.get("text") or c.get("message", {}).get("content")) for c in body["choices"]], \
        body["usage"]["prompt_tokens"]


def _error(r) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


# -- fields that change nothing: served, the answer the one without them ----------------------------------
ACCEPTED = [
    ("metadata", {"session": "s1", "app": "langchain"}), ("metadata", {}), ("metadata", None),
    ("store", False), ("store", True), ("store", None),  # (true too: vLLM ignores it; nothing is stored either way)
    ("service_tier", "auto"), ("service_tier", "default"), ("service_tier", None),
    ("prompt_cache_key", "user-42"), ("prompt_cache_retention", "24h"), ("prompt_cache_retention", "in_memory"),
    ("prompt_cache_options", {"mode": "explicit", "ttl": "30m"}),
    ("safety_identifier", "hash-of-user"),
]


@pytest.mark.parametrize("path", [CHAT, CMPL], ids=["chat", "cmpl"])
@pytest.mark.parametrize("name,value", ACCEPTED, ids=[f"{n}={json.dumps(v)}" for n, v in ACCEPTED])
def test_fields_that_change_nothing_are_served_with_the_same_answer(srv, path, name, value):
    alone = ok(srv, path, BASE[path])
    assert _answer(ok(srv, path, {**BASE[path], name: value})) == _answer(alone)


CHAT_NEUTRAL = [("verbosity", "medium"), ("modalities", ["text"]), ("audio", None), ("prediction", None),
                ("web_search_options", None), ("moderation", None), ("functions", []), ("function_call", "none"),
                ("function_call", "auto"), ("verbosity", None), ("modalities", None)]


@pytest.mark.parametrize("name,value", CHAT_NEUTRAL, ids=[f"{n}={json.dumps(v)}" for n, v in CHAT_NEUTRAL])
def test_a_chats_fields_at_their_neutral_values_are_served(srv, name, value):
    alone = ok(srv, CHAT, BASE[CHAT])
    assert _answer(ok(srv, CHAT, {**BASE[CHAT], name: value})) == _answer(alone)


def test_the_openai_sdk_sends_them(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        r = c.chat.completions.create(model="tiny", messages=HI, max_completion_tokens=3, temperature=0, store=False,
                                      metadata={"k": "v"}, service_tier="auto", prompt_cache_key="u1",
                                      safety_identifier="h1", verbosity="medium", modalities=["text"],
                                      reasoning_effort="low")
        assert r.usage.completion_tokens == 3


# -- fields that would change the answer: any other value is 'unsupported_value' ----------------------------
UNSUPPORTED = [
    (CHAT, "verbosity", "low"), (CHAT, "verbosity", "high"), (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "modalities", []), (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "prediction", {"type": "content", "content": "hi"}), (CHAT, "web_search_options", {}),
    (CHAT, "moderation", {"model": "omni-moderation-latest"}),
    (CHAT, "functions", [{"name": "f", "parameters": {"type": "object"}}]), (CHAT, "function_call", {"name": "f"}),
    (CHAT, "service_tier", "flex"), (CMPL, "service_tier", "priority"),
]


@pytest.mark.parametrize("path,name,value", UNSUPPORTED,
                         ids=[f"{_where(p)}-{n}={json.dumps(v)}" for p, n, v in UNSUPPORTED])
def test_other_values_are_unsupported_naming_the_field(srv, path, name, value):
    err = _error(post(srv, path, {**BASE[path], name: value}))
    assert (err["param"], err["code"]) == (name, "unsupported_value"), err
    assert f"'{name}' is not supported" in err["message"], err


WRONG_TYPES = [
    (CHAT, "metadata", {"k": 1}), (CHAT, "metadata", "k=v"), (CMPL, "metadata", ["k"]), (CHAT, "store", "false"),
    (CMPL, "store", 0), (CHAT, "service_tier", 1), (CHAT, "service_tier", "bogus"), (CHAT, "prompt_cache_key", 7),
    (CMPL, "safety_identifier", {"id": 1}), (CHAT, "prompt_cache_retention", "1h"),
    (CHAT, "prompt_cache_options", {"mode": "implicit", "ttl": "1h"}),
    (CHAT, "reasoning_effort", "extreme"), (CHAT, "reasoning_effort", 2), (CHAT, "verbosity", "loud"),
    (CHAT, "modalities", "text"), (CHAT, "modalities", ["image"]), (CHAT, "audio", "alloy"),
    (CHAT, "web_search_options", True), (CHAT, "functions", {"name": "f"}),
]


@pytest.mark.parametrize("path,name,value", WRONG_TYPES,
                         ids=[f"{_where(p)}-{n}={json.dumps(v)}" for p, n, v in WRONG_TYPES])
def test_wrong_types_are_400s_naming_the_field(srv, path, name, value):
    err = _error(post(srv, path, {**BASE[path], name: value}))
    assert err["param"].partition(".")[0] == name and err["code"] == "invalid_type", err  # (a nested one: its path)


# the output-changing fields are a chat's (OpenAI's Completions defines none), and a typo is still unknown
@pytest.mark.parametrize("path,name,value", [(CMPL, "reasoning_effort", "low"), (CMPL, "verbosity", "medium"),
                                             (CMPL, "modalities", ["text"]), (CHAT, "reasoning_efort", "low"),
                                             (CHAT, "metdata", {}), (CMPL, "stroe", False),
                                             (CHAT, "prompt_cache_options", {"x": 1})])
def test_unknown_fields_are_still_unknown(srv, path, name, value):
    err = _error(post(srv, path, {**BASE[path], name: value}))
    assert (err["param"].partition(".")[0], err["code"]) == (name, "unknown_field"), err  # (a nested one: its path)


# -- reasoning_effort: a template variable, as vLLM passes it ---------------------------------------------
def _rendered(srv, **body) -> str:
    req = ChatCompletionRequest.model_validate({"messages": HI, **body})
    return srv.tok.decode(chat_ids(req, srv.tok))


def test_reasoning_effort_reaches_the_template_with_enable_thinking(srv):
    assert _rendered(srv) == "<user>hi\n<assistant>"
    assert _rendered(srv, reasoning_effort=None) == "<user>hi\n<assistant>"
    for effort in ("minimal", "low", "medium", "high", "xhigh", "max"):  # (vLLM's: thinking on for each)
        assert _rendered(srv, reasoning_effort=effort) == f"<user>hi\n<assistant>[effort={effort}][thinking=True]"
    # "none": vLLM's enable_thinking false (Qwen3's template then closes an empty think block)
    assert _rendered(srv, reasoning_effort="none") == "<user>hi\n<assistant>[effort=none][thinking=False]"


def test_chat_template_kwargs_enable_thinking_wins_and_reasoning_effort_over_theirs(srv):
    """vLLM's merge: the request's reasoning_effort over chat_template_kwargs' one, their enable_thinking kept."""
    kwargs = {"enable_thinking": False, "reasoning_effort": "low"}
    assert _rendered(srv, chat_template_kwargs=kwargs) == "<user>hi\n<assistant>[effort=low][thinking=False]"
    assert _rendered(srv, chat_template_kwargs=kwargs, reasoning_effort="high") == \
        "<user>hi\n<assistant>[effort=high][thinking=False]"
    assert kwargs == {"enable_thinking": False, "reasoning_effort": "low"}  # (the request's left as it came)


def test_reasoning_effort_over_http_is_the_prompt_the_engine_gets(srv):
    plain = ok(srv, CHAT, BASE[CHAT])
    high = ok(srv, CHAT, {**BASE[CHAT], "reasoning_effort": "high"})
    assert high["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + len("[effort=high][thinking=True]")
    # the prompt's tokens (the first has no logprob, so no entry of its own): the rendered text
    shown = ok(srv, CHAT, {**BASE[CHAT], "reasoning_effort": "minimal", "prompt_logprobs": 0})["prompt_logprobs"]
    text = "".join(next(iter(entry.values()))["decoded_token"] for entry in shown[1:])
    assert text == "user>hi\n<assistant>[effort=minimal][thinking=True]"


def test_a_template_failing_on_reasoning_effort_names_it(tmp_path_factory):
    strict = TEMPLATE + "{% if reasoning_effort is defined and reasoning_effort == 'max' %}" \
                        "{{ raise_exception('no max effort here') }}{% endif %}"
    with byte_level_server(tmp_path_factory, tiny_config(), chat_template=strict) as s:
        err = _error(post(s, CHAT, {**BASE[CHAT], "reasoning_effort": "max"}))
        assert err["param"] == "reasoning_effort" and "no max effort here" in err["message"], err
        ok(s, CHAT, {**BASE[CHAT], "reasoning_effort": "high"})
        # with chat_template_kwargs that render: still the effort's fault
        err = _error(post(s, CHAT, {**BASE[CHAT], "reasoning_effort": "max", "chat_template_kwargs": {"x": 1}}))
        assert err["param"] == "reasoning_effort", err


def test_a_responses_reasoning_effort_reaches_the_template_as_a_chats(srv):
    """/v1/responses' reasoning.effort is its chat's reasoning_effort (vLLM's Responses passes it on alike)."""
    def input_tokens(**body) -> int:
        return ok(srv, "/v1/responses", {"input": "hi", "max_output_tokens": 1, **body})["usage"]["input_tokens"]

    chat = ok(srv, CHAT, {**BASE[CHAT], "reasoning_effort": "low"})["usage"]["prompt_tokens"]
    assert input_tokens(reasoning={"effort": "low"}) == chat
    assert input_tokens(reasoning={"summary": "auto"}) == chat - len("[effort=low][thinking=True]")
    err = _error(post(srv, "/v1/responses", {"input": "hi", "reasoning": {"effort": "extreme"}}))
    assert err["param"] == "reasoning.effort" and "'reasoning.effort'" in err["message"], err

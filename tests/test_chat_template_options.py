"""vLLM's chat-template options on /v1/chat/completions, as /tokenize's chat form takes them
(scheduler/api_inputs.py `chat_ids`): `chat_template_kwargs` (Qwen3's enable_thinking), `add_generation_prompt`,
`continue_final_message`, `add_special_tokens`. They were a 400 "unknown field" on a chat completion, so a
Qwen3 client's `extra_body={"chat_template_kwargs": {"enable_thinking": False}}` could not be served."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

BOS = 256
HI = [{"role": "user", "content": "hi"}]
# Qwen3's switch, as its template writes it: an empty think block opens the turn when thinking is off
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>"
            "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
            "{% if persona %}({{ persona }}){% endif %}{% endif %}")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), special=("<s>",), bos="<s>",  # (<s>: id BOS)
                                config={"chat_template": TEMPLATE, "bos_token": "<s>"})
    tokenizer = HFTokenizer(str(path))
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=tokenizer)) as s:
        s.tokenizer = tokenizer
        yield s


def _chat(s, **body) -> httpx.Response:
    return httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 1, **body}, timeout=30)


def _prompt_tokens(s, **body) -> int:
    r = _chat(s, **body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def _tokens(s, text: str) -> int:
    return len(s.tokenizer.encode(text, add_special_tokens=False))


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_chat_template_kwargs_reach_the_template(srv):
    assert _prompt_tokens(srv) == _tokens(srv, "<s><user>hi\n<assistant>")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _prompt_tokens(srv, **off) == _tokens(srv, "<s><user>hi\n<assistant><think></think>")
    assert _prompt_tokens(srv, chat_template_kwargs={"enable_thinking": True, "persona": "terse"}) == \
        _tokens(srv, "<s><user>hi\n<assistant>(terse)")
    # /tokenize counts what the chat completion reports
    r = httpx.post(srv.url + "/tokenize", json={"messages": HI, **off}, timeout=30)
    assert r.status_code == 200 and r.json()["count"] == _prompt_tokens(srv, **off), r.text


def test_the_openai_sdk_extra_body_of_a_qwen3_client(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as c:
        r = c.chat.completions.create(model="tiny", messages=HI, max_tokens=2, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == _tokens(srv, "<s><user>hi\n<assistant><think></think>")
    assert r.usage.completion_tokens == 2


def test_continue_final_message_and_the_generation_prompt(srv):
    convo = [*HI, {"role": "assistant", "content": "Hel"}]
    assert _prompt_tokens(srv, messages=convo, add_generation_prompt=False, continue_final_message=True) == \
        _tokens(srv, "<s><user>hi\n<assistant>Hel")
    assert _prompt_tokens(srv, add_generation_prompt=False) == _tokens(srv, "<s><user>hi\n")
    # the template writes the BOS; add_special_tokens adds the tokenizer's own too (as vLLM's)
    assert _prompt_tokens(srv, add_special_tokens=True) == _tokens(srv, "<s><user>hi\n<assistant>") + 1
    err = _error(_chat(srv, messages=convo, continue_final_message=True))
    assert err["param"] == "continue_final_message" and "add_generation_prompt" in err["message"], err


@pytest.mark.parametrize("kwargs, says", [
    ({"messages": []}, "'messages' (the server sets it)"),
    ({"add_generation_prompt": False}, "use the request's field"),
    ({"continue_final_message": True}, "use the request's field"),
    ({"bos_token": "<x>"}, "'bos_token'"),
])
def test_kwargs_may_not_set_what_the_server_sets(srv, kwargs, says):
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(srv.url + path, json={"messages": HI, "max_tokens": 1, "chat_template_kwargs": kwargs}
                       if path != "/tokenize" else {"messages": HI, "chat_template_kwargs": kwargs}, timeout=30)
        err = _error(r)
        assert err["param"] == "chat_template_kwargs" and says in err["message"], err


@pytest.mark.parametrize("kwargs, param", [
    ("thinking off", "chat_template_kwargs"),  # not an object
    ({"persona": "\ud800"}, "chat_template_kwargs"),  # a lone surrogate: not text UTF-8 can encode
])
def test_bad_kwargs_are_a_400_naming_the_field(srv, kwargs, param):
    body = json.dumps({"messages": HI, "max_tokens": 1, "chat_template_kwargs": kwargs})
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert _error(r)["param"] == param


def test_a_completion_takes_none_of_them(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                      "chat_template_kwargs": {"enable_thinking": False}}, timeout=30)
    err = _error(r)
    assert err["param"] == "chat_template_kwargs" and err["code"] == "unknown_field", err

"""Structured outputs over HTTP (scheduler/api_guided.py): OpenAI's response_format, vLLM's guided_* fields
and structured_outputs, on completions and chat; streamed as the whole response; errors name their field."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

PETS = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "indoor": {"type": "boolean"}},
        "required": ["kind", "indoor"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """The tiny model with a byte-level checkpoint tokenizer and a chat template (completions also work
    with the presets' byte tokenizer; chat needs a template)."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"), config={"chat_template": template})
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=2048))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=HFTokenizer(str(path)))) as s:
        yield s


def _post(s, path: str, **body) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=60)


def _chat(s, **body) -> dict:
    r = _post(s, "/v1/chat/completions", **{"messages": [{"role": "user", "content": "a pet?"}], "max_tokens": 40,
                                            **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _complete(s, **body) -> dict:
    r = _post(s, "/v1/completions", **{"prompt": "a pet: ", "max_tokens": 40, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _pet(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"kind", "indoor"} and value["kind"] in ("cat", "dog") and isinstance(value["indoor"], bool)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_way_to_ask_for_a_schema(srv, seed):
    sampled = {"temperature": 1.0, "seed": seed}
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PETS, "strict": True}}
    for choice in (_chat(srv, response_format=fmt, **sampled), _complete(srv, response_format=fmt, **sampled)):
        _pet(choice.get("text", choice.get("message", {}).get("content")))
        assert choice["finish_reason"] == "stop"
    _pet(_complete(srv, guided_json=PETS, **sampled)["text"])
    _pet(_complete(srv, guided_json=json.dumps(PETS), **sampled)["text"])  # (a schema as JSON text, as vLLM takes)
    _pet(_chat(srv, structured_outputs={"json": PETS}, **sampled)["message"]["content"])


def test_regex_choice_grammar_and_json_object(srv):
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", _complete(srv, guided_regex=r"[A-Z]{2}-[0-9]{4}")["text"])
    assert _chat(srv, guided_choice=["red", "green"])["message"]["content"] in ("red", "green")
    assert _complete(srv, structured_outputs={"choice": ["up", "down"]})["text"] in ("up", "down")
    for seed in range(3):
        sum_ = _complete(srv, guided_grammar='start: /[0-9]{1,3}/ "+" /[0-9]{1,3}/', seed=seed)
        assert sum_["finish_reason"] == "stop" and re.fullmatch(r"[0-9]{1,3}\+[0-9]{1,3}", sum_["text"]), sum_
    text = _chat(srv, response_format={"type": "json_object"}, temperature=1.0, seed=3)["message"]["content"]
    assert text.startswith("{")
    plain = _chat(srv, response_format={"type": "text"}, temperature=0)  # (nothing asked: the unguided answer)
    assert plain["message"]["content"] == _chat(srv, temperature=0)["message"]["content"]


def test_a_stream_adds_up_to_the_response(srv):
    body = {"messages": [{"role": "user", "content": "a pet?"}], "max_tokens": 40, "temperature": 1.0, "seed": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": PETS}}}
    whole = _post(srv, "/v1/chat/completions", **body).json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content", "")
    assert text == whole
    _pet(text)


def test_the_openai_sdk_parses_into_a_pydantic_model(srv):
    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        indoor: bool

    with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as c:
        done = c.beta.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "a pet?"}],
                                             response_format=Pet, max_tokens=40, temperature=1.0, seed=1)
    pet = done.choices[0].message.parsed
    assert isinstance(pet, Pet) and isinstance(pet.indoor, bool)


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
])
def test_a_bad_ask_is_a_400_naming_its_field(srv, body, param):
    for path in ("/v1/completions", "/v1/chat/completions"):
        extra = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
        r = _post(srv, path, max_tokens=4, **extra, **body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_the_server_builds_the_grammars_tokenizer_at_start():
    """Off its loop, before any guided request (a real vocabulary takes ~1 s to build)."""
    import time

    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    assert "_tokenizer" not in engine.guides.__dict__
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))):
        deadline = time.monotonic() + 30
        while "_tokenizer" not in engine.guides.__dict__ and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.guides.__dict__.get("_tokenizer") is not None

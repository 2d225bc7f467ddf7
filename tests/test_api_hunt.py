"""The OpenAI-compatible API as real clients use it (a bug hunt: the openai SDK, LangChain, curl):
OpenAI request fields at values that change nothing, chat content this server cannot take, roles a
template does not name, and HTTP methods and routes. A real server on the CPU (tiny preset, a
byte-level checkpoint tokenizer with a chat template); the harness is tests/test_server.py's. Each
test failed before its fix (scheduler/api_models.py, scheduler/server.py, scheduler/tokenizer.py)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from scheduler.tokenizer import HFTokenizer
from server_fixtures import byte_level_server, tiny_config
from test_server_text import _write_byte_level_tokenizer

# as Qwen's template does, it renders the roles it knows and skips any other
TEMPLATE = ("{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
            "<{{ m['role'] }}>{{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    config = tiny_config(num_pages=200, max_new_tokens_limit=16)
    with byte_level_server(tmp_path_factory, config, chat_template=TEMPLATE) as s:
        yield s


def _post(srv, chat: bool, body: dict) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"messages": HI} if chat else {"prompt": [5, 6, 7]}
    return httpx.post(srv.url + path, json={**base, "max_tokens": 2, **body}, timeout=60)


# -- OpenAI fields this server takes only at their neutral values -------------------------------------------
NEUTRAL = [
    (False, {"logit_bias": {}}), (False, {"logit_bias": None}), (True, {"logit_bias": {}}),
    (True, {"top_logprobs": 0, "logprobs": False}), (True, {"response_format": {"type": "text"}}),
    (True, {"tools": []}), (True, {"tool_choice": "none"}), (True, {"tool_choice": "auto"}),
]


@pytest.mark.parametrize("chat,body", NEUTRAL, ids=[f"{'chat' if c else 'cmpl'}-{json.dumps(b)}" for c, b in NEUTRAL])
def test_openai_fields_at_a_value_that_changes_nothing_are_served(srv, chat, body):
    """Regression: each was an "unknown field" 400. LangChain's OpenAI LLM sends `logit_bias: {}` by
    default (so every call failed), and response_format {"type": "text"} is OpenAI's default."""
    r = _post(srv, chat, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_the_openai_sdk_sends_an_empty_logit_bias(client):
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, logit_bias={})
    assert r.usage.completion_tokens == 2


UNSUPPORTED = [  # (logit_bias is served: tests/test_logit_bias.py; response_format: tests/test_guided_api.py;
    (True, "top_logprobs", 2),  # tools: tests/test_tool_calls.py)
]


@pytest.mark.parametrize("chat,name,value", UNSUPPORTED, ids=[f"{n}={json.dumps(v)}" for _, n, v in UNSUPPORTED])
def test_openai_fields_at_other_values_are_unsupported_not_unknown(srv, chat, name, value):
    """Regression: a 400 "unknown field 'tools' (extra fields are not permitted)" read as a typo in
    the client; the field is known and its value is what is not supported."""
    r = _post(srv, chat, {name: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (name, "unsupported_value"), err
    assert f"'{name}' is not supported" in err["message"], err


# -- chat messages -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
                         ids=lambda p: p["type"])
def test_a_non_text_content_part_is_a_400_that_says_so(srv, client, part):
    """Regression: an image part was a 400 "Input should be a valid string; or Input should be
    'text'; or Field required; or Extra inputs are not permitted" (every union branch's complaint)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("messages.0", "unsupported_value"), err
    assert f"'{part['type']}' are not supported" in err["message"] and "messages.0" in err["message"], err
    with pytest.raises(openai.BadRequestError, match=part["type"]):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)


def test_a_developer_message_reaches_a_template_that_names_only_system(client):
    """Regression: OpenAI's developer messages are its newer system messages; a template that
    renders only the roles it knows (Qwen's) dropped them, and the model never saw the instructions
    (served with a 200). They reach such a template as system messages."""
    def prompt_tokens(role: str | None) -> int:
        messages = ([{"role": role, "content": "answer in French"}] if role else []) + HI
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage.prompt_tokens
    bare = prompt_tokens(None)
    assert prompt_tokens("developer") == prompt_tokens("system") > bare


def test_a_template_that_names_the_developer_role_gets_it_as_it_is(tmp_path):
    _write_byte_level_tokenizer(tmp_path)  # renders every role as <role>; the role named in a comment
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{#- knows 'developer' -#}" + config["chat_template"]}))
    tok = HFTokenizer(str(tmp_path))
    text = tok.decode(tok.apply_chat_template([{"role": "developer", "content": "x"}, *HI]))
    assert text.startswith("<developer>x\n"), text


# -- HTTP: methods and routes ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/health", "/version", "/v1/models", "/v1/models/tiny", "/metrics", "/hicache/status"])
def test_get_routes_answer_head(srv, path):
    """Regression: HEAD (`curl -I`, uptime checks) was a 405 on every GET route; RFC 9110 requires
    a server to answer HEAD wherever it answers GET."""
    r = httpx.head(srv.url + path, timeout=30)
    assert r.status_code == 200 and r.content == b"", (r.status_code, r.content)
    assert r.headers["content-type"] == httpx.get(srv.url + path, timeout=30).headers["content-type"]


def test_a_405_says_which_methods_are_allowed(srv):
    """Regression: Starlette's 405 carries the Allow header RFC 9110 requires; the JSON error
    handler dropped it. The error names the method and path too."""
    r = httpx.get(srv.url + "/v1/completions", timeout=30)
    assert r.status_code == 405 and r.headers.get("allow") == "POST", dict(r.headers)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "GET /v1/completions" in err["message"], err
    r = httpx.request("OPTIONS", srv.url + "/health", timeout=30)
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}, dict(r.headers)


def test_the_openai_sdk_retrieves_the_served_model(srv, client):
    """Regression: GET /v1/models/{id} (the SDK's models.retrieve) was a 404 for the served model."""
    listed = client.models.list().data[0]
    got = client.models.retrieve("tiny")
    assert got.id == listed.id == "tiny" and got.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    err = httpx.get(srv.url + "/v1/models/gpt-4o", timeout=30).json()["error"]
    assert (err["param"], err["code"]) == ("model", "model_not_found"), err

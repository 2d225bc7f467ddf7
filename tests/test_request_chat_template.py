"""vLLM's per-request `chat_template` (a chat's field, or chat_template_kwargs' key as transformers takes it):
refused with vLLM's message unless the server runs with --trust-request-chat-template, then rendered in place of
the server's template, also where the server has none (the presets' byte tokenizer). It was an unknown-field 400."""
from __future__ import annotations

import pytest

from scheduler.engine import Engine
from scheduler.serve import build_parser
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer
from server_fixtures import byte_level_server, ok, post, tiny_config
from test_server import ServerThread

OWN = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def untrusted(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config()) as s:
        yield s


@pytest.fixture(scope="module")
def trusted():
    """A server that trusts requests' templates, over the presets' byte tokenizer (no template of its own)."""
    engine = Engine(tiny_config())
    limits = ServerLimits(shutdown_grace_s=1.0, trust_request_chat_template=True)
    with ServerThread(create_app(engine, limits, tokenizer=ByteTokenizer(engine.vocab_size))) as s:
        s.engine = engine
        yield s


def _detokenized(srv, body: dict) -> str:
    tokens = ok(srv, "/tokenize", body)["tokens"]
    return ok(srv, "/detokenize", {"tokens": tokens})["prompt"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("field, value", [("chat_template", OWN), ("chat_template_kwargs", {"chat_template": OWN})])
def test_an_untrusted_servers_refusal_is_vllms(untrusted, path, field, value):
    r = post(untrusted, path, {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, field: value}
             if path != "/tokenize" else {"messages": MESSAGES, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "--trust-request-chat-template is not set" in err["message"], err


def test_a_trusted_request_renders_its_own_template(trusted):
    assert _detokenized(trusted, {"messages": MESSAGES, "chat_template": OWN}) == "[user:hi]>"
    kwargs_form = {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": OWN}}
    assert _detokenized(trusted, kwargs_form) == "[user:hi]>"
    out = ok(trusted, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                               "chat_template": OWN})
    assert out["usage"]["prompt_tokens"] == len("[user:hi]>")
    assert out["usage"]["completion_tokens"] == 2


def test_without_its_own_template_the_template_less_server_still_says_so(trusted):
    r = post(trusted, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_unavailable", r.text


@pytest.mark.parametrize("body, param", [
    ({"chat_template": "{% for m in messages %}"}, "chat_template"),  # does not compile
    ({"chat_template": OWN, "chat_template_kwargs": {"chat_template": OWN + "!"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"chat_template": 5}}, "chat_template_kwargs"),
    ({"chat_template": 5}, "chat_template"),
])
def test_a_bad_request_template_is_a_400_naming_it(trusted, body, param):
    r = post(trusted, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert post(trusted, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                  "chat_template": OWN}).status_code == 200  # (the server serves on)


def test_the_flag_and_its_default():
    assert build_parser().parse_args(["--model", "tiny"]).trust_request_chat_template is False
    assert build_parser().parse_args(["--model", "tiny", "--trust-request-chat-template"]).trust_request_chat_template
    tok = ByteTokenizer(512)
    assert tok.request_template(OWN) is tok.request_template(OWN)  # (compiled once per text)


def test_a_template_that_renders_past_any_prompt_is_stopped(trusted):
    """A trusted request's template of nested loops rendered 100 M characters (1.5 GB) on the server's loop before
    the prompt's length was checked: the rendering stops at MAX_RENDERED_CHARS, a 400."""
    from scheduler.chat_template import MAX_RENDERED_CHARS
    loops = "{% for i in range(400) %}{% for j in range(1000) %}" + "x" * 100 + "{% endfor %}{% endfor %}"
    r = post(trusted, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                               "chat_template": loops})
    assert r.status_code == 400 and f"more than {MAX_RENDERED_CHARS:,} characters" in r.json()["error"]["message"]

"""A message's content as vLLM hands it to the chat template (session 79's hunt): vLLM's default
`--chat-template-content-format auto` reads the template's Jinja AST, and a template that loops over a message's
content (Llama 4's, Gemma 3's, SmolVLM's, Mistral-Small-3.1's: `{% for item in message['content'] %}`) gets the
content as OpenAI's list of parts ("openai"), a plain string as one text part; the others get one string
("string", text parts "\\n"-joined, empty ones left out). Here every template got the string, so such a template
iterated its characters: the user's text vanished from the prompt. A chat's `tools: []` reaches the template as
[] (vLLM's, transformers'), not as None."""
from __future__ import annotations

import pytest

from scheduler import serve
from scheduler.chat_template import ChatTemplate
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer
from server_fixtures import ok, post, tiny_config
from test_mutation_rest_s63 import _serve_until_the_app
from test_server import ServerThread

# SmolVLM's shape: the content's parts only (a string's characters have no 'type')
PARTS = ("{% for message in messages %}{{ message['role'] | capitalize }}: {% for line in message['content'] %}"
         "{% if line['type'] == 'text' %}{{ line['text'] }}{% endif %}{% endfor %}<end>\n{% endfor %}"
         "{% if add_generation_prompt %}Assistant:{% endif %}")
# a template that shows which form it got
SHOWS = ("{% for m in messages %}{{ m.role }}={% if m.content is string %}S:{{ m.content }}{% else %}"
         "L{{ m.content | length }}:{{ m.content | map(attribute='text') | join('|') }}{% endif %};{% endfor %}")
# the same, detected as "openai" (a loop over the content, never entered)
SHOWS_OPENAI = SHOWS + ("{% for m in messages %}{% if false %}{% for p in m['content'] %}{% endfor %}{% endif %}"
                        "{% endfor %}")
TOOLS_SEEN = "{% if tools is none %}none{% else %}{{ tools | length }} tools{% endif %}"
HELLO = [{"role": "user", "content": "hello"}]


def _server(**limits):
    engine = Engine(tiny_config())
    return ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0, trust_request_chat_template=True,
                                                        **limits), tokenizer=ByteTokenizer(engine.vocab_size)))


@pytest.fixture(scope="module")
def srv():
    with _server(chat_template=PARTS) as s:
        yield s


def _text(s, body: dict) -> str:
    return ok(s, "/detokenize", {"tokens": ok(s, "/tokenize", body)["tokens"]})["prompt"]


@pytest.mark.parametrize("content", ["hello", [{"type": "text", "text": "hello"}]])
def test_a_template_over_the_contents_parts_sees_the_users_text(srv, content):
    # (regression: "User: <end>\nAssistant:", the text gone, as a string or as parts)
    assert _text(srv, {"messages": [{"role": "user", "content": content}]}) == "User: hello<end>\nAssistant:"
    out = ok(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    assert out["usage"]["prompt_tokens"] == len("User: hello<end>\nAssistant:")


@pytest.mark.parametrize("template, want", [
    (SHOWS, "user=S:a\nb;assistant=S:;tool=S:t1\nt2;"),
    (SHOWS_OPENAI, "user=L3:a||b;assistant=L0:;tool=S:t1\nt2;"),  # (a tool's: joined, as vLLM's)
])
def test_each_template_gets_the_form_it_reads(srv, template, want):
    messages = [{"role": "user", "content": [{"type": "text", "text": t} for t in ("a", "", "b")]},
                {"role": "assistant", "content": None},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": t} for t in ("t1", "t2")]}]
    # (a request's own template: detected as the server's is; "string" leaves the empty part out, as vLLM's)
    assert _text(srv, {"messages": messages, "chat_template": template, "add_generation_prompt": False}) == want


@pytest.mark.parametrize("loop", [
    "{% for m in messages %}{% for p in m['content'] %}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
    "{% for m in messages[1:] %}{% for p in m.content | default([]) %}{% endfor %}{% endfor %}",
    "{% set loop_messages = messages %}{% set ms = loop_messages %}{% for m in ms %}{% for p in m['content'] %}"
    "{% endfor %}{% endfor %}",
    "{% macro render(content) %}{% for item in content %}{{ item.text }}{% endfor %}{% endmacro %}",
])
def test_a_loop_over_a_messages_content_is_detected_as_vllm_detects_it(loop):
    assert ChatTemplate(loop).content_format == "openai"


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}{% for c in m['content'].split('\n') %}{{ c }}{% endfor %}{% endfor %}",
    "{% for x in tools %}{% for p in x['content'] %}{% endfor %}{% endfor %}",
    "{% set a = messages %}{% set b = a %}{% set a = b %}{{ a }}",  # (a cycle of names: vLLM's search never ended)
    "{% for i, m in messages | dictsort %}{% for p in m.content %}{% endfor %}{% endfor %}",  # (vLLM: unknown)
])
def test_other_templates_get_a_string(template):
    assert ChatTemplate(template).content_format == "string"


def test_continue_final_message_goes_on_from_the_last_text_part(srv):
    parts = [{"type": "text", "text": "Sure"}, {"type": "text", "text": "thing"}]
    body = {"messages": [*HELLO, {"role": "assistant", "content": parts}], "add_generation_prompt": False,
            "continue_final_message": True}
    assert _text(srv, body) == "User: hello<end>\nAssistant: Surething"
    r = post(srv, "/tokenize", {**body, "messages": [*HELLO, {"role": "assistant", "content": []}]})
    assert r.status_code == 400 and "no text to continue" in r.json()["error"]["message"], r.text


def test_the_flag_sets_the_form_for_every_template(monkeypatch):
    parser = serve.build_parser()
    assert parser.parse_args(["--model", "tiny"]).chat_template_content_format == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "tiny", "--chat-template-content-format", "list"])
    limits = _serve_until_the_app(monkeypatch, "--chat-template-content-format", "openai")
    assert limits.chat_template_content_format == "openai"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        ServerLimits(chat_template_content_format="list")
    with _server(chat_template=SHOWS, chat_template_content_format="openai") as s:
        assert _text(s, {"messages": HELLO, "add_generation_prompt": False}) == "user=L1:hello;"
        own = {"messages": HELLO, "add_generation_prompt": False, "chat_template": SHOWS}
        assert _text(s, own) == "user=L1:hello;"
    with _server(chat_template=SHOWS_OPENAI, chat_template_content_format="string") as s:
        assert _text(s, {"messages": HELLO, "add_generation_prompt": False}) == "user=S:hello;"


@pytest.mark.parametrize("tools, want", [(None, "none"), ([], "0 tools")])
def test_an_empty_tools_list_reaches_the_template_as_one(srv, tools, want):
    body = {"messages": HELLO, "chat_template": TOOLS_SEEN, **({} if tools is None else {"tools": tools})}
    assert _text(srv, body) == want
    out = ok(srv, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert out["usage"]["prompt_tokens"] == len(want)

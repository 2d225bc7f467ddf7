"""--chat-template (vLLM's flag; scheduler/chat_template.py): a file or the template itself renders chats in place
of the checkpoint's, and gives the presets' byte tokenizer a chat; one that does not compile stops the server
before the model loads."""
from __future__ import annotations

import httpx
import pytest

from scheduler import serve
from scheduler.chat_template import ChatTemplate, read_chat_template
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer, HFTokenizer
from test_server import ServerThread
from tokenizer_files import write_byte_tokenizer

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[a] {% endif %}"
HI = [{"role": "user", "content": "hi"}]


def test_the_flag_reads_a_file_or_takes_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE == read_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="neither a file nor a template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_a_template_that_does_not_compile_stops_the_server_before_the_model_loads(capsys):
    assert serve.main(["--port", "0", "--device", "cpu", "--model", "tiny",
                       "--chat-template", "{% for m in messages %}"]) == 2
    assert "does not compile" in capsys.readouterr().err
    assert serve.build_parser().parse_args(["--model", "tiny"]).chat_template is None


def test_the_byte_tokenizer_renders_a_chat_with_it():
    tok = ByteTokenizer(512)
    with pytest.raises(ValueError, match="--chat-template"):
        tok.apply_chat_template(HI)
    tok.use_chat_template(TEMPLATE)
    assert tok.decode(tok.apply_chat_template(HI)) == "[user] hi\n[a] "
    assert tok.chat_template == TEMPLATE
    # (the template's rendering is the checkpoint tokenizer's: developer as system, continue_final_message)
    text = ChatTemplate(TEMPLATE).render([{"role": "developer", "content": "be brief"},
                                          {"role": "assistant", "content": "Sure"}], add_generation_prompt=False,
                                         continue_final_message=True)
    assert text == "[system] be brief\n[assistant] Sure"


@pytest.fixture(scope="module")
def tiny_chat():
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0, chat_template=TEMPLATE))) as s:
        yield s


def test_a_preset_serves_chat_with_the_flag(tiny_chat):
    r = httpx.post(tiny_chat.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("[user] hi\n[a] ".encode())
    status = httpx.get(tiny_chat.url + "/hicache/status", timeout=60).json()["server"]
    assert status["chat_template"] is True and status["limits"]["chat_template"] is True


def test_it_replaces_a_checkpoints_own_template(tmp_path):
    path = write_byte_tokenizer(tmp_path, config={"chat_template": "{{ messages[0].content }}!"})
    own = HFTokenizer(str(path))
    assert own.decode(own.apply_chat_template(HI)) == "hi!"
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    create_app(engine, ServerLimits(chat_template=TEMPLATE), tokenizer=own)
    assert own.decode(own.apply_chat_template(HI)) == "[user] hi\n[a] "


def test_a_length_refusal_names_the_field_the_chat_used(tiny_chat):
    """The engine refuses prompt + output tokens past the L1 pool naming 'max_tokens'; a chat that sent
    max_completion_tokens (OpenAI's newer name) is told about that field (regression: 'max_tokens')."""
    for field in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(tiny_chat.url + "/v1/chat/completions", json={"messages": HI, field: 510}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and f"{field} (510)" in err["message"], err

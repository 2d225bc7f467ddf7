"""The HTTP server's text path (scheduler/server.py, scheduler/api_models.py, scheduler/tokenizer.py):
tokenizers and incremental decoding, chat templates, text the tokenizers cannot take, and the
chat's default length. The server harness is tests/test_server.py's."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDecoder
from test_server import GOOD, ServerThread


# -- tokenizer ---------------------------------------------------------------------------------------
def test_byte_tokenizer_roundtrip_and_incremental_decode():
    tok = ByteTokenizer(512)
    text = "héllo, 世界 ✓"
    ids = tok.encode(text)
    assert all(3 <= i < 259 for i in ids) and tok.decode(ids) == text
    assert tok.decode([3 + ord("a"), 300, 3 + ord("b")]) == "a<id:300>b"
    for seq in (ids, [3 + 0xE4, 400, 3 + 0xB8, 3 + ord("x"), 3 + 0xE4, 3 + 0xB8]):
        dec = IncrementalDecoder(tok)
        assert "".join(dec.feed(t) for t in seq) + dec.flush() == tok.decode(seq)
    with pytest.raises(ValueError):
        ByteTokenizer(200)


# -- chat with a template, draining -----------------------------------------------------------------------
def _write_byte_level_tokenizer(path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))


def test_chat_with_template_and_draining(tmp_path):
    _write_byte_level_tokenizer(tmp_path)
    tokenizer = HFTokenizer(str(tmp_path))
    assert tokenizer.chat_template is not None
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    limits = ServerLimits(shutdown_grace_s=1.0, max_tokens_limit=64)
    with ServerThread(create_app(engine, limits, tokenizer=tokenizer)) as s:
        with openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0) as c:
            messages = [{"role": "user", "content": "hi"}]
            r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
            expected_prompt = len(tokenizer.encode("<user>hi\n<assistant>", add_special_tokens=False))
            assert r.object == "chat.completion" and r.usage.prompt_tokens == expected_prompt
            assert r.choices[0].message.role == "assistant" and len(r.choices[0].model_extra["token_ids"]) == 4
            # without max_tokens a chat gets what is left of its context (OpenAI's chat has no default;
            # it used to get the completions' 16), within --max-tokens-limit (64 here)
            free = c.chat.completions.create(model="tiny", messages=messages)
            assert free.usage.completion_tokens == 64 and free.choices[0].finish_reason == "length"
            chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True,
                                                    temperature=0))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
            assert chunks[-1].choices[0].finish_reason == "length"
        # shutting down: new requests and health checks get 503
        s.call(s.app.state.hc.begin_shutdown)
        r = httpx.post(s.url + "/v1/completions", json=GOOD)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(s.url + "/health").status_code == 503


def test_a_checkpoint_tokenizer_refuses_text_utf8_cannot_encode(tmp_path):
    """JSON allows lone surrogates: the HF tokenizer raised TypeError (a 500) on such a prompt, and a
    chat message's was blamed on the template."""
    _write_byte_level_tokenizer(tmp_path)
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=HFTokenizer(str(tmp_path)))) as s:
        for path, body, param in (
                ("/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 2}', "prompt"),
                ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages")):
            r = httpx.post(s.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param and "not valid Unicode" in r.json()["error"]["message"]


@pytest.mark.parametrize("template,chat_ok", [
    ("{% for m in messages %}{% if loop.index > 5 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}", True),
    ("{% for m in messages %}{{ m['content'] }", False),  # does not compile
])
def test_a_chat_template_that_does_not_compile_leaves_completions_served(tmp_path, template, chat_ok):
    """A template that did not compile (or used {% break %}, which transformers renders) stopped the
    server from starting, completions and all."""
    _write_byte_level_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = HFTokenizer(str(tmp_path))
    assert (tokenizer.chat_template is not None) == chat_ok
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=tokenizer)) as s:
        assert httpx.post(s.url + "/v1/completions", json=GOOD, timeout=30).status_code == 200
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 2}, timeout=30)
        assert r.status_code == (200 if chat_ok else 400), r.text
        if not chat_ok:
            assert "does not compile" in r.json()["error"]["message"]


def test_a_chat_template_in_its_own_file_is_read(tmp_path):
    """Recent transformers save the template as chat_template.jinja, not in tokenizer_config.json."""
    _write_byte_level_tokenizer(tmp_path)
    template = json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text(template)
    assert HFTokenizer(str(tmp_path)).chat_template == template


def test_a_chat_without_max_tokens_gets_what_is_left_of_its_context():
    from types import SimpleNamespace

    from scheduler.api_inputs import parse_prompts

    tokenizer = SimpleNamespace(apply_chat_template=lambda messages, **_: list(range(1, 101)))  # 100 prompt tokens
    body = {"messages": [{"role": "user", "content": "hi"}]}
    kw = dict(tokenizer=tokenizer, served_names={"tiny"}, model_name="tiny", vocab_size=512, prompt_limit=1000)
    _, [ids], params = parse_prompts(body, True, max_tokens_limit=64, context_tokens=120, **kw)
    assert len(ids) == 100 and params.max_tokens == 21  # 100 + 21 - 1 = 120 tokens of K/V
    _, _, params = parse_prompts(body, True, max_tokens_limit=64, context_tokens=4096, **kw)
    assert params.max_tokens == 64
    _, _, params = parse_prompts({"prompt": [1, 2]}, False, max_tokens_limit=64, context_tokens=4096, **kw)
    assert params.max_tokens == 16  # a completion keeps OpenAI's legacy default


@pytest.mark.parametrize("messages", [
    [{"role": "usr", "content": "hi"}],
    [{"role": "", "content": "hi"}],
    [{"role": "user"}],
    [{"role": "system", "content": None}, {"role": "user", "content": "hi"}],
], ids=["typo-role", "empty-role", "user-no-content", "system-null-content"])
def test_a_chat_message_with_an_unknown_role_or_no_content_is_a_400(tmp_path, messages):
    """Regression: any string was a role and any message could lack content; a typo'd role or a
    forgotten content was rendered into a prompt the model never saw and served with a 200 (OpenAI
    answers 400). An assistant's message may still come without content."""
    _write_byte_level_tokenizer(tmp_path)
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))
    limits = ServerLimits(shutdown_grace_s=1.0, max_tokens_limit=16)
    with ServerThread(create_app(engine, limits, tokenizer=HFTokenizer(str(tmp_path)))) as s:
        ok = [{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}]
        assert httpx.post(s.url + "/v1/chat/completions", json={"messages": ok, "max_tokens": 2}).status_code == 200
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 400, r.text[:200]
        assert r.json()["error"]["param"].startswith("messages.0"), r.text[:200]  # (the message, or its field)

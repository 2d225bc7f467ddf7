"""Text in and out of the OpenAI-compatible server (scheduler/tokenizer.py, scheduler/server.py,
scheduler/api_models.py): prompt shapes OpenAI allows, chat templates rendered as transformers renders
them, and completion text that continues the prompt's text. Real servers on the CPU (tiny preset);
the server harness is tests/test_server.py's."""
from __future__ import annotations

import datetime
import json
import os

import httpx
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_server import ServerThread
from test_server_text import _write_byte_level_tokenizer


@pytest.fixture(scope="module")
def byte_srv():
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=200, max_new_tokens_limit=64))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        yield s


def _sse(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """The chunks of a stream (framing checked: `data: {...}` events, then `data: [DONE]`)."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-3:]
    assert all(e.startswith("data: {") for e in events[:-2]), events
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


# -- prompt: a list holding one prompt ---------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [["hello"], [[3 + b for b in b"hello"]]], ids=["[string]", "[[token ids]]"])
def test_a_prompt_list_holding_one_prompt_is_that_prompt(byte_srv, prompt):
    """OpenAI's `prompt` may be an array of strings or an array of token arrays (one choice per
    prompt); `["hello"]` is the one prompt "hello" (LangChain's OpenAI LLM sends that). It was a
    400 "Input should be a valid string; or Input should be a valid integer"."""
    with httpx.Client(base_url=byte_srv.url, timeout=60) as c:
        body = {"max_tokens": 4, "temperature": 0}
        ref = c.post("/v1/completions", json={**body, "prompt": "hello"}).json()
        r = c.post("/v1/completions", json={**body, "prompt": prompt})
        assert r.status_code == 200, r.text
        got = r.json()
        assert len(got["choices"]) == 1
        assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        assert got["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("prompt", [["a", "b"], [[5, 6], [7, 8]]], ids=["strings", "token-arrays"])
def test_a_batch_of_prompts_gets_one_choice_each(byte_srv, prompt):
    # (it was a 400 "one prompt per request"; tests/test_stop_batch_api.py covers batches)
    r = httpx.post(byte_srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    assert [(c["index"], len(c["token_ids"])) for c in r.json()["choices"]] == [(0, 2), (1, 2)]


# -- chat templates render as transformers renders them ---------------------------------------------------------
def test_a_chat_template_sees_what_transformers_passes_it(tmp_path):
    """transformers renders a chat template with tools=None and documents=None, a `tojson` that
    neither HTML-escapes nor ASCII-escapes, and `strftime_now`. Here `tools` was undefined (so a
    template's `tools is not none` held and a tool section was rendered into a prompt without
    tools), tojson turned "<b> & café" into "\\u003cb\\u003e \\u0026 caf\\u00e9", and templates
    that date their system prompt with strftime_now (Llama 3.x) fell back to a fixed date."""
    _write_byte_level_tokenizer(tmp_path)
    template = ("{% if tools is not none %}[TOOLS]{% endif %}{% if documents is not none %}[DOCS]{% endif %}"
                "{% for m in messages %}{{ m['content'] | tojson }}\n{% endfor %}"
                "{% if strftime_now is defined %}{{ strftime_now('%Y') }}{% else %}no-date{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = HFTokenizer(str(tmp_path))
    before = datetime.datetime.now().year
    text = tok.decode(tok.apply_chat_template([{"role": "user", "content": "<b> & café"}]))
    years = {str(before), str(datetime.datetime.now().year)}
    assert text.split("\n")[0] == '"<b> & café"', text
    assert text.split("\n")[1] in years, text


# -- completion text continues the prompt's text -------------------------------------------------------------
def _write_llama_style_tokenizer(path, n: int = 512) -> None:
    """A Llama-2 / Mistral style tokenizer.json: SentencePiece words ('▁' marks a space), byte
    fallback, and a decoder that strips the one leading space of what it decodes."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    vocab["▁"] = len(vocab)
    for w in letters:
        vocab[w] = len(vocab)
    for w in letters:
        vocab["▁" + w] = len(vocab)
    i = 0
    while len(vocab) < n:  # the rest of the tiny model's 512 ids: words that start with a space
        vocab[f"▁w{i}"] = len(vocab)
        i += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", w) for w in letters], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(os.path.join(str(path), "tokenizer.json"))


def _llama_style_server(tmp_path):
    _write_llama_style_tokenizer(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=200, max_new_tokens_limit=64))
    return tok, ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0), tokenizer=tok))


PROMPTS = ("a b", "The capital of France is", "x", "hello world")


def test_a_sentencepiece_completion_keeps_the_space_before_its_first_word(tmp_path):
    """With a Llama-2 style tokenizer a completion's first token "▁w7" was decoded on its own, and
    the decoder strips the leading space of what it decodes: prompt "a b" continued by "▁w7" came
    back as "w7", so prompt + text read "a bw7". OpenAI's completion text is what follows the
    prompt's text (" w7"), streamed or not."""
    tok, server = _llama_style_server(tmp_path)
    spaced = 0
    with server as s, httpx.Client(base_url=s.url, timeout=60) as c:
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            first = tok.tok.id_to_token(choice["token_ids"][0])
            if first.startswith("▁"):  # a word: its text follows the prompt's after a space
                spaced += 1
                word = first[1:]
                assert choice["text"].startswith(" " + word), (prompt, first, choice["text"])
                assert (prompt + choice["text"]).startswith(prompt + " " + word)
                streamed = "".join(ch["choices"][0]["text"] for ch in _sse(c, "/v1/completions", body))
                assert streamed.startswith(" " + word), (prompt, first, streamed)
    assert spaced >= 1  # at least one completion began with a '▁' word (the case that lost its space)


def test_streamed_and_whole_text_agree_with_a_byte_fallback_tokenizer(tmp_path):
    """A byte-fallback decoder (Llama 2, Mistral) decodes a run of byte tokens that ends inside a
    character as one U+FFFD per byte: the whole text of "\\t", "t", <0xE4> was "\ufffd\ufffd\ufffd"
    while the stream had sent "\\t", "t" and then "\ufffd". The same greedy request must carry
    the same text streamed or not."""
    tok, server = _llama_style_server(tmp_path)
    with server as s, httpx.Client(base_url=s.url, timeout=60) as c:
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
            choice = c.post("/v1/completions", json=body).json()["choices"][0]
            chunks = _sse(c, "/v1/completions", body)
            assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == choice["token_ids"]
            assert "".join(ch["choices"][0]["text"] for ch in chunks) == choice["text"], prompt
            assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]

"""vLLM's /tokenize and /detokenize (scheduler/api_tokenize.py) on the HTTP server: the presets' byte
tokenizer, and a checkpoint tokenizer with a chat template. The server harness is tests/test_server.py's."""
from __future__ import annotations

import httpx
import pytest

from scheduler import server
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer
from test_server import ServerThread, metric_samples
from tokenizer_files import write_byte_tokenizer

HI = [{"role": "user", "content": "hi"}]
BOS = 256


def _write_tokenizer(path) -> None:
    """The 256 byte-level tokens and a BOS "<s>" (id 256) that a plain encode adds; a template that writes
    the BOS, then "<role>content\\n" per message."""
    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    write_byte_tokenizer(path, special=("<s>",), bos="<s>", config={"chat_template": template, "bos_token": "<s>"})


def _engine() -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512))


@pytest.fixture(scope="module")
def srv():
    with ServerThread(create_app(_engine(), ServerLimits(shutdown_grace_s=1.0))) as s:
        yield s


@pytest.fixture(scope="module")
def chat_srv(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    _write_tokenizer(path)
    tokenizer = HFTokenizer(str(path))
    with ServerThread(create_app(_engine(), ServerLimits(shutdown_grace_s=1.0), tokenizer=tokenizer)) as s:
        s.tokenizer = tokenizer
        yield s


def _post(s, path: str, **body) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=30)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# -- the byte tokenizer ----------------------------------------------------------------------------------
def test_tokenize_then_detokenize_round_trips_on_the_byte_tokenizer(srv):
    text = "héllo, 世界 ✓"
    r = _post(srv, "/tokenize", model="tiny", prompt=text)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == [b + 3 for b in text.encode()] and body["count"] == len(body["tokens"])
    assert body["token_strs"] is None
    assert body["max_model_len"] == httpx.get(srv.url + "/v1/models").json()["data"][0]["max_model_len"]
    r = _post(srv, "/detokenize", model="tiny", tokens=body["tokens"])
    assert r.status_code == 200 and r.json() == {"prompt": text}, r.text
    assert _post(srv, "/detokenize", tokens=[]).json() == {"prompt": ""}
    assert _post(srv, "/tokenize", prompt="").json()["count"] == 0


def test_return_token_strs_names_each_token(srv, chat_srv):
    body = _post(srv, "/tokenize", prompt="a b\né", return_token_strs=True).json()
    assert body["token_strs"] == ["a", " ", "b", "<0x0A>", "<0xC3>", "<0xA9>"]
    assert len(body["tokens"]) == body["count"] == 6
    body = _post(chat_srv, "/tokenize", prompt="hi é", return_token_strs=True).json()
    assert body["token_strs"] == ["<s>", "h", "i", "Ġ", "Ã", "©"], body  # (the vocabulary's own, as vLLM's)


def test_special_tokens_are_added_and_kept_as_vllm_does(chat_srv):
    hi = chat_srv.tokenizer.encode("hi", add_special_tokens=False)
    assert _post(chat_srv, "/tokenize", prompt="hi").json()["tokens"] == [BOS, *hi]
    assert _post(chat_srv, "/tokenize", prompt="hi", add_special_tokens=False).json()["tokens"] == hi
    assert _post(chat_srv, "/detokenize", tokens=[BOS, *hi]).json() == {"prompt": "<s>hi"}
    # a chat's template writes the BOS: none added unless asked (then two, as vLLM's)
    lt = chat_srv.tokenizer.encode("<", add_special_tokens=False)
    assert _post(chat_srv, "/tokenize", messages=HI).json()["tokens"][:2] == [BOS, *lt]
    assert _post(chat_srv, "/tokenize", messages=HI, add_special_tokens=True).json()["tokens"][:2] == [BOS, BOS]


@pytest.mark.parametrize("prompt", ["The capital of France is", "naïve ✓ 世界\n"])
def test_count_is_what_a_completion_reports_as_prompt_tokens(srv, chat_srv, prompt):
    for s in (srv, chat_srv):
        count = _post(s, "/tokenize", prompt=prompt).json()["count"]
        r = _post(s, "/v1/completions", prompt=prompt, max_tokens=1)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == count


# -- the chat form --------------------------------------------------------------------------------------
def test_chat_form_renders_as_chat_completions_does(chat_srv):
    tok = chat_srv.tokenizer
    body = _post(chat_srv, "/tokenize", messages=HI).json()
    assert body["tokens"] == tok.encode("<s><user>hi\n<assistant>", add_special_tokens=False)
    r = _post(chat_srv, "/v1/chat/completions", messages=HI, max_tokens=1)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == body["count"], r.text
    body = _post(chat_srv, "/tokenize", messages=HI, add_generation_prompt=False).json()
    assert body["tokens"] == tok.encode("<s><user>hi\n", add_special_tokens=False)
    # the last message left open for the model to continue (its end-of-turn markup cut off)
    convo = [*HI, {"role": "assistant", "content": "Hel"}]
    body = _post(chat_srv, "/tokenize", messages=convo, add_generation_prompt=False, continue_final_message=True,
                 return_token_strs=True).json()
    assert tok.decode(body["tokens"], skip_special_tokens=False) == "<s><user>hi\n<assistant>Hel"
    assert body["token_strs"][-3:] == ["H", "e", "l"] and len(body["token_strs"]) == body["count"]
    err = _error(_post(chat_srv, "/tokenize", messages=convo, continue_final_message=True), 400)
    assert err["param"] == "continue_final_message", err  # (add_generation_prompt defaults to true: vLLM's 400)
    err = _error(_post(chat_srv, "/tokenize", messages=[{"role": "user"}]), 400)
    assert err["param"] == "messages.0", err


def test_chat_form_without_a_template_is_the_400_chat_gives(srv):
    chat = _error(_post(srv, "/v1/chat/completions", messages=HI), 400)
    assert _error(_post(srv, "/tokenize", messages=HI), 400) == chat
    assert chat["code"] == "chat_template_unavailable"


# -- refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,code", [([3, 512], "invalid_token_id"), ([-1], "invalid_token_id"),
                                         (["a"], "invalid_type"), ([1.5], "invalid_type"), (None, "missing_field")])
def test_detokenize_refuses_ids_outside_the_vocabulary(srv, tokens, code):
    body = {} if tokens is None else {"tokens": tokens}
    err = _error(httpx.post(srv.url + "/detokenize", json=body, timeout=30), 400)
    assert err["param"] in ("tokens", "tokens.0") and err["code"] == code, err  # (a bad item: its path)
    if code == "invalid_token_id":
        assert f"token id {tokens[-1]} is outside the vocabulary [0, 512)" in err["message"], err


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "hi"}), ("/tokenize", {"messages": HI}),
                                       ("/detokenize", {"tokens": [3]})])
def test_a_model_not_served_is_refused_as_completions_refuse_it(srv, path, body):
    completion = _error(_post(srv, "/v1/completions", model="gpt-4", prompt="hi"), 404)
    assert _error(_post(srv, path, model="gpt-4", **body), 404) == completion
    assert completion["param"] == "model" and completion["code"] == "model_not_found"


@pytest.mark.parametrize("body,param,code", [
    ({}, "prompt", "missing_field"),
    ({"model": "tiny"}, "prompt", "missing_field"),
    ({"prompt": [1, 2]}, "prompt", "invalid_type"),  # (vLLM's /tokenize takes text)
    ({"prompt": "hi", "max_tokens": 4}, "max_tokens", "unknown_field"),  # strict, as /v1/completions
    ({"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens", "invalid_type"),
    ({"prompt": "hi", "messages": HI}, "prompt", "unknown_field"),
])
def test_a_bad_tokenize_body_is_a_400_naming_the_field(srv, body, param, code):
    err = _error(httpx.post(srv.url + "/tokenize", json=body, timeout=30), 400)
    assert (err["param"], err["code"]) == (param, code), err
    if body in ({}, {"model": "tiny"}):
        assert "'messages'" in err["message"], err  # (says the chat form is the other choice)


def test_text_utf8_cannot_encode_is_a_400(chat_srv):
    for body, param in ((b'{"prompt": "a\\ud800"}', "prompt"),
                        (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages")):
        r = httpx.post(chat_srv.url + "/tokenize", content=body, headers={"content-type": "application/json"})
        assert _error(r, 400)["param"] == param


def test_no_generation_slot_and_no_completion_metrics():
    """With every generation slot taken (none here) both still answer; neither counts as a completion."""
    limits = ServerLimits(shutdown_grace_s=1.0)
    object.__setattr__(limits, "max_concurrent_requests", 0)  # (every slot taken; ServerLimits refuses a 0 of a user's)
    with ServerThread(create_app(_engine(), limits)) as s:
        before = metric_samples(s.url)
        assert _post(s, "/v1/completions", prompt="hi", max_tokens=1).status_code == 429
        assert _post(s, "/tokenize", prompt="hi").status_code == 200
        assert _post(s, "/detokenize", tokens=[3, 4]).status_code == 200
        assert _post(s, "/tokenize", messages=HI).status_code == 400
        after = metric_samples(s.url)
        requests = {k: v for k, v in after.items() if k[0] == "hicache_requests_total"}
        assert requests == {**{k: v for k, v in before.items() if k[0] == "hicache_requests_total"},
                            ("hicache_requests_total", (("outcome", "rejected"),)): 1.0}  # (the 429)
        assert after[("hicache_prompt_tokens_total", ())] == 0


def test_without_a_tokenizer_both_are_a_400(monkeypatch):
    monkeypatch.setattr(server, "load_tokenizer", lambda model, vocab_size: None)
    with ServerThread(create_app(_engine(), ServerLimits(shutdown_grace_s=1.0))) as s:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [3]})):
            err = _error(_post(s, path, **body), 400)
            assert "no tokenizer" in err["message"], err
        assert _error(_post(s, "/tokenize", messages=HI), 400)["code"] == "chat_template_unavailable"

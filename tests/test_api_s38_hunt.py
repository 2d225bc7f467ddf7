"""The OpenAI-compatible API with a checkpoint's sampling defaults (a bug hunt, session 38): requests a
client may send under generation_config.json's defaults, and bodies that must be a 400 naming the field.
A real server on the CPU: the tiny checkpoint of tests/test_generation_defaults.py (Qwen3's file) with a
byte-level tokenizer and chat template (tests/test_server_text.py). Each test failed before its fix."""
from __future__ import annotations

import contextlib
import dataclasses
import json

import httpx
import pytest
from test_generation_defaults import QWEN3, write_generation_config
from test_loader import random_model, write_checkpoint
from test_server import ServerThread
from test_server_text import _write_byte_level_tokenizer

from scheduler import serve
from scheduler.config import config_from_args
from scheduler.engine import Engine
from scheduler.loader import export_hf_state_dict
from scheduler.server import ServerLimits, create_app

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    src = random_model(False)
    path = write_checkpoint(tmp_path_factory.mktemp("s38") / "ckpt", src.cfg, export_hf_state_dict(src))
    _write_byte_level_tokenizer(path)
    return write_generation_config(path, {**QWEN3, "repetition_penalty": 1.05, "min_p": 0.01})


@pytest.fixture(scope="module")
def srv(ckpt):
    """The app hicache-serve builds for the checkpoint (--generation-config auto)."""
    args = serve.build_parser().parse_args(["--model", str(ckpt), "--device", "cpu", "--num-pages", "64"])
    engine = Engine(dataclasses.replace(config_from_args(args), max_new_tokens_limit=64))
    limits = ServerLimits(shutdown_grace_s=1.0, sampling_defaults=serve._generation_defaults(args))
    with ServerThread(create_app(engine, limits)) as s:
        s.engine = engine
        yield s


def post_raw(srv, chat: bool, raw: str) -> httpx.Response:
    """A body sent as these exact bytes (a lone surrogate's escape stays as JSON allows it)."""
    return httpx.post(srv.url + ("/v1/chat/completions" if chat else "/v1/completions"), content=raw.encode(),
                      headers={"content-type": "application/json"}, timeout=60)


# -- text a client sends that UTF-8 cannot carry ------------------------------------------------------------
def test_a_content_part_type_holding_a_lone_surrogate_is_a_400_naming_messages(srv):
    """Regression: a 500 "internal error: UnicodeEncodeError": the part's type went raw into the
    validation error's message, which pydantic cannot render (JSON allows "\\ud800", UTF-8 does not)."""
    r = post_raw(srv, True, '{"messages": [{"role": "user", "content": [{"type": "\\ud800"}]}], "max_tokens": 2}')
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("messages.0", "unsupported_value"), err
    assert "content parts of type '\\ud800' are not supported" in err["message"], err
    srv.call(srv.engine.check_integrity)


# -- a bad sampling field beside a stream the checkpoint's defaults sample -------------------------------------
BAD = [("temperature", 100.5), ("temperature", "0.6"), ("temperature", True), ("top_p", 0), ("top_p", 1.01),
       ("top_k", -2), ("top_k", 20.0), ("top_k", True), ("min_p", 1.01), ("min_p", -0.01), ("repetition_penalty", 0),
       ("repetition_penalty", 10.01), ("presence_penalty", 2.01), ("seed", 1 << 64), ("seed", False), ("n", 0),
       ("n", 17), ("n", 1.0), ("max_tokens", 65), ("max_tokens", 1 << 80), ("min_tokens", 99)]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("key", ["\\ud800", "x\\udc00y"])
def test_a_field_name_holding_a_lone_surrogate_is_a_400_that_says_so(srv, chat, key):
    """Session 39. Regression: "invalid value for field 'body': Input should be a valid string, unable to
    parse raw data as a unicode string", naming neither the key nor what is wrong with it."""
    body = '"messages": [{"role": "user", "content": "hi"}]' if chat else '"prompt": "hi"'
    for raw in (f'{{{body}, "max_tokens": 2, "{key}": 1}}',
                f'{{{body[:-2]}, "{key}": 1}}], "max_tokens": 2}}' if chat else None):
        if raw is None:
            continue
        r = post_raw(srv, chat, raw)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_value", err
        assert "holds a lone surrogate, which UTF-8 cannot carry" in err["message"], err
        assert repr(json.loads(f'"{key}"')) in err["message"], err


def test_best_of_below_n_is_a_400_naming_best_of(srv):
    """Session 39. Regression: best_of 1 with n 3 was served (three choices); OpenAI and vLLM answer
    a 400, as best_of counts the candidates that the n choices are taken from."""
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of": 1, "n": 3},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("best_of", "invalid_value"), err
    assert "'best_of' must be >= 'n'" in err["message"], err
    ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of": 1, "n": 1},
                    timeout=60)
    assert ok.status_code == 200, ok.text


def test_bad_sampling_fields_are_400s_naming_them_while_a_defaulted_stream_runs(srv):
    """Each endpoint, each bad value (NaN and Infinity as JSON's extensions too): a 400 whose param is the
    field; a seeded stream that takes the checkpoint's defaults, open meanwhile, gets the tokens it gets alone."""
    body = {"prompt": [11, 12, 13, 14, 15], "max_tokens": 64, "seed": 5, "ignore_eos": True}
    alone = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        lines = stream.iter_lines()
        chunks = [next(lines)]  # (its first token: it runs)
        for chat in (False, True):
            base = {"messages": HI} if chat else {"prompt": [1, 2, 3]}
            raws = [json.dumps({**base, name: value}) for name, value in BAD]
            raws += [f'{json.dumps(base)[:-1]}, "{name}": {v}}}' for name in ("temperature", "top_p", "min_p",
                     "repetition_penalty", "frequency_penalty") for v in ("NaN", "Infinity", "-Infinity")]
            for raw in raws:
                r = post_raw(srv, chat, raw)
                name = next(iter(json.loads(raw).keys() - base.keys()))
                assert r.status_code == 400 and r.json()["error"]["param"] == name, (raw, r.text)
        chunks += list(lines)
    streamed = [t for line in chunks if line.startswith("data: {") for c in json.loads(line[6:])["choices"]
                for t in c["token_ids"]]
    assert streamed == alone and len(alone) == 64
    srv.call(srv.engine.check_integrity)


# -- --generation-config as vLLM takes it -----------------------------------------------------------------------
def test_generation_config_takes_a_directory_as_vllms_does(ckpt, tmp_path, capsys):
    """vLLM's --generation-config is auto, vllm or a directory holding generation_config.json (its
    defaults then, whatever the model); regression: a directory was argparse's "invalid choice"."""
    args = serve.build_parser().parse_args(["--port", "0", "--model", "tiny", "--generation-config", str(ckpt)])
    assert serve._check_server_args(args) is None
    defaults = serve._generation_defaults(args)
    assert defaults.given() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.01,
                                "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text("{}")
    for bad in (tmp_path / "missing", ckpt.parent, ""):  # no directory; one without the file; "" (not the cwd)
        with contextlib.chdir(tmp_path):
            assert serve.main(["--port", "0", "--device", "cpu", "--model", "tiny",
                               "--generation-config", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hicache-serve: --generation-config ") and str(bad) in err and err.count("\n") == 1, err

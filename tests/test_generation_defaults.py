"""A checkpoint's generation_config.json sampling defaults (scheduler/generation_defaults.py), as vLLM's
`--generation-config auto` serves them: reading and checking each key, the request fields they fill
(api_inputs.parse_prompts), and through the real app on a tiny checkpoint: a request without the fields
samples as one that gives the file's values, a request's own values win, `--generation-config vllm`
ignores the file, and a bad value stops hicache-serve before the model loads, naming the file and key."""
from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import httpx
import pytest
from test_loader import random_model, write_checkpoint
from test_server import ServerThread

from scheduler import serve
from scheduler.api_inputs import parse_prompts
from scheduler.api_models import APIError
from scheduler.config import config_from_args
from scheduler.engine import Engine
from scheduler.generation_defaults import GenerationDefaults, read_generation_defaults
from scheduler.loader import CheckpointError, export_hf_state_dict
from scheduler.presets import PRESETS
from scheduler.server import ServerLimits, create_app

# Qwen3-8B's generation_config.json, its end id made the tiny model's (random_model: 7)
QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [7], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}
QWEN3_DEFAULTS = GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20)
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def write_generation_config(path: Path, content) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# -- reading ----------------------------------------------------------------------------------------------
def test_no_file_no_defaults(tmp_path):
    defaults = read_generation_defaults(tmp_path)
    assert defaults == GenerationDefaults() and defaults.describe() is None
    assert GenerationDefaults.__dataclass_params__.frozen


def test_qwen3s_file_gives_its_three_and_ignores_the_other_keys(tmp_path):
    defaults = read_generation_defaults(write_generation_config(tmp_path, QWEN3))
    assert defaults == QWEN3_DEFAULTS and isinstance(defaults.top_k, int)
    assert defaults.describe() == ("sampling defaults from generation_config.json: temperature 0.6, top_p 0.95, "
                                   "top_k 20 (--generation-config vllm: OpenAI's)")


def test_do_sample_false_and_max_new_tokens_are_not_read(tmp_path):
    """As vLLM: do_sample is not read (a file saying false still sets the temperature), nor are keys
    other than the five (max_new_tokens: the server's max_tokens defaults stay)."""
    path = write_generation_config(tmp_path, {"do_sample": False, "max_new_tokens": 5, "temperature": 0.7,
                                              "num_beams": 1, "typical_p": 0.5})
    assert read_generation_defaults(path) == GenerationDefaults(temperature=0.7)


@pytest.mark.parametrize("key,value,read", [
    ("temperature", 0, 0.0), ("temperature", 100, 100.0), ("temperature", 0.7, 0.7),
    ("top_p", 1, 1.0), ("top_p", 1e-6, 1e-6),
    ("top_k", 40, 40), ("top_k", 0, 0), ("top_k", -1, -1),
    ("min_p", 0, 0.0), ("min_p", 1, 1.0), ("min_p", 0.05, 0.05),
    ("repetition_penalty", 1.05, 1.05), ("repetition_penalty", 10, 10.0),
    ("temperature", None, None), ("top_k", None, None),  # null: not set
])
def test_each_key_is_read(tmp_path, key, value, read):
    defaults = read_generation_defaults(write_generation_config(tmp_path, {key: value}))
    assert defaults == GenerationDefaults(**{key: read})
    assert type(getattr(defaults, key)) is type(read)


@pytest.mark.parametrize("key,value,says", [
    ("temperature", 100.5, "must be in [0, 100], got 100.5"), ("temperature", -0.1, "[0, 100]"),
    ("temperature", "0.6", 'must be a number, got "0.6"'), ("temperature", True, "got true"),
    ("top_p", 0, "must be in (0, 1], got 0"), ("top_p", 1.5, "(0, 1]"), ("top_p", [0.9], "must be a number"),
    ("top_k", 20.0, "must be an integer >= -1"), ("top_k", -2, "got -2"), ("top_k", "20", '"20"'),
    ("top_k", False, "got false"),
    ("min_p", 1.5, "must be in [0, 1]"), ("min_p", -0.01, "[0, 1]"),
    ("repetition_penalty", 0, "must be in (0, 10]"), ("repetition_penalty", 10.5, "(0, 10]"),
    ("repetition_penalty", {"x": 1}, "must be a number"),
])
def test_a_bad_value_names_the_file_and_the_key(tmp_path, key, value, says):
    path = write_generation_config(tmp_path, {"temperature": 0.6, key: value})
    with pytest.raises(CheckpointError) as exc:
        read_generation_defaults(path)
    message = str(exc.value)
    assert message.startswith(f"{path / 'generation_config.json'}: '{key}' ") and says in message, message


@pytest.mark.parametrize("content,says", [("NaN", "JSON object"), ('{"top_p": NaN}', "'top_p' must be in (0, 1]"),
                                          ("[0.6]", "JSON object, not list"), ("{", "Expecting")])
def test_a_file_that_is_not_a_json_object_of_numbers_is_refused(tmp_path, content, says):
    with pytest.raises(CheckpointError, match="generation_config.json: ") as exc:
        read_generation_defaults(write_generation_config(tmp_path, content))
    assert says in str(exc.value)


def complete(body: dict, defaults: GenerationDefaults = GenerationDefaults()):
    _, _, params = parse_prompts({"prompt": [1, 2, 3], **body}, False, tokenizer=None, served_names=set(),
                                 model_name="m", vocab_size=512, prompt_limit=100, max_tokens_limit=64,
                                 sampling_defaults=defaults)
    return params


@pytest.mark.parametrize("key,values", [
    ("temperature", [-0.01, 0, 0.6, 100, 100.01]), ("top_p", [0, 1e-9, 0.95, 1, 1.01]),
    ("top_k", [-2, -1, 0, 20, 20.0]), ("min_p", [-0.01, 0, 0.5, 1, 1.01]),
    ("repetition_penalty", [0, 1e-9, 1.1, 10, 10.01]),
])
def test_the_file_takes_what_the_api_takes(tmp_path, key, values):
    for value in values:
        try:
            complete({key: value})
            api_ok = True
        except APIError:
            api_ok = False
        try:
            read_generation_defaults(write_generation_config(tmp_path, {key: value}))
            file_ok = True
        except CheckpointError:
            file_ok = False
        assert api_ok == file_ok, (key, value, api_ok, file_ok)


# -- the request fields they fill ----------------------------------------------------------------------
ALL = GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1)


def sampling_fields(params) -> dict:
    return {k: getattr(params, k) for k in NEUTRAL}


def test_fields_left_out_or_null_take_the_defaults():
    assert sampling_fields(complete({})) == NEUTRAL  # no defaults: OpenAI's
    assert sampling_fields(complete({}, ALL)) == dataclasses.asdict(ALL)
    assert sampling_fields(complete({k: None for k in NEUTRAL}, ALL)) == dataclasses.asdict(ALL)
    assert sampling_fields(complete({"top_p": 0.5}, QWEN3_DEFAULTS)) == {**NEUTRAL, "temperature": 0.6,
                                                                         "top_k": 20, "top_p": 0.5}


def test_a_requests_own_values_win_even_the_neutral_ones():
    assert sampling_fields(complete(NEUTRAL, ALL)) == NEUTRAL
    assert sampling_fields(complete({"top_k": -1}, ALL))["top_k"] == -1  # (off, as 0)
    greedy = complete({"temperature": 0}, ALL)
    assert greedy.temperature == 0.0 and greedy.top_k == 20  # (greedy ignores top_k)


# -- through the app ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    src = random_model(False)
    path = write_checkpoint(tmp_path_factory.mktemp("gen") / "ckpt", src.cfg, export_hf_state_dict(src))
    return write_generation_config(path, QWEN3)


@contextlib.contextmanager
def serving(model: str, *flags: str):
    """The app hicache-serve builds for these flags (its parser, its defaults), served on a free port."""
    args = serve.build_parser().parse_args(["--model", model, "--device", "cpu", "--num-pages", "64", *flags])
    engine = Engine(dataclasses.replace(config_from_args(args), max_new_tokens_limit=64))
    with ServerThread(create_app(engine, ServerLimits(sampling_defaults=serve._generation_defaults(args)))) as s:
        yield s


def token_ids(srv, **fields) -> list[int]:
    body = {"prompt": [11, 12, 13, 14, 15], "max_tokens": 24, "seed": 5, "ignore_eos": True, **fields}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_through_the_app_the_files_defaults_apply_and_a_requests_values_win(ckpt):
    with serving(str(ckpt)) as srv:  # --generation-config auto, the default
        limits = httpx.get(srv.url + "/hicache/status", timeout=30).json()["server"]["limits"]
        assert limits["sampling_defaults"] == {**dataclasses.asdict(GenerationDefaults()), "temperature": 0.6,
                                               "top_p": 0.95, "top_k": 20}
        defaulted = token_ids(srv)
        explicit = token_ids(srv, temperature=0.6, top_p=0.95, top_k=20)
        nulls = token_ids(srv, temperature=None, top_p=None, top_k=None)
        neutral = token_ids(srv, temperature=1.0, top_p=1.0, top_k=-1)
        greedy = token_ids(srv, temperature=0)
    assert defaulted == explicit == nulls and len(defaulted) == 24
    assert neutral != defaulted and greedy != defaulted
    with serving(str(ckpt), "--generation-config", "vllm") as srv:
        limits = httpx.get(srv.url + "/hicache/status", timeout=30).json()["server"]["limits"]
        assert limits["sampling_defaults"] == dataclasses.asdict(GenerationDefaults())
        assert token_ids(srv) == neutral  # the file ignored: OpenAI's defaults
        assert token_ids(srv, temperature=0.6, top_p=0.95, top_k=20) == defaulted
        assert token_ids(srv, temperature=0, top_k=7) == greedy


def flags(*argv: str):
    return serve.build_parser().parse_args(list(argv))


def test_which_runs_read_the_file(tmp_path):
    bad = write_generation_config(tmp_path / "bad", {"top_p": 2})
    assert serve._generation_defaults(flags("--model", str(bad), "--generation-config", "vllm")) == GenerationDefaults()
    assert flags().generation_config == "auto"
    for preset in PRESETS:
        assert serve._generation_defaults(flags("--model", preset)) == GenerationDefaults()
    with pytest.raises(CheckpointError, match="'top_p'"):
        serve._generation_defaults(flags("--model", str(bad)))


def test_a_bad_value_stops_the_server_before_the_model_loads(tmp_path, capsys):
    """One line naming the file and the key, exit status 2; the directory has no weights at all, so
    the file was checked before the model was loaded."""
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_config()))
    write_generation_config(path, {**QWEN3, "top_k": 20.5})
    code = serve.main(["--port", "0", "--device", "cpu", "--model", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err == f"hicache-serve: {path / 'generation_config.json'}: 'top_k' must be an integer >= -1 " \
                  f"(0 or -1: off), got 20.5\n", err

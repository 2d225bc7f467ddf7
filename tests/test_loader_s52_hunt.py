"""Regressions from session 52's hunt of checkpoint loading: a checkpoint directory named like a preset is the model
(vLLM takes an existing local path; the preset's random weights were loaded with the directory's tokenizer), and a
tokenizer file the server cannot read is one line naming it before the weights load (a traceback naming no file,
after them)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from scheduler import serve
from scheduler.model import load_model
from scheduler.presets import PRESETS, is_preset, model_config_of
from scheduler.tokenizer import ByteTokenizer, load_tokenizer
from test_loader_hunt import hf_tensors, write
from tokenizer_files import write_byte_tokenizer

CFG = dataclasses.replace(PRESETS["tiny"], eos_token_id=7)  # (the preset has none: which one loaded shows)


def test_a_checkpoint_directory_named_like_a_preset_is_the_model(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    assert is_preset("tiny")  # (a directory without config.json is no checkpoint: the preset still)
    write(tmp_path / "tiny", CFG.to_hf_config(), hf_tensors(CFG, seed=3))
    write_byte_tokenizer(tmp_path / "tiny")
    assert not is_preset("tiny")
    assert model_config_of("tiny").eos_token_id == 7
    _, cfg, identity = load_model("tiny", torch.device("cpu"), torch.float32, seed=0)
    assert identity.startswith("ckpt:") and cfg.eos_token_id == 7
    assert not isinstance(load_tokenizer("tiny", cfg.vocab_size), ByteTokenizer)
    assert is_preset("qwen3-8b")


@pytest.mark.parametrize("name, content", [("tokenizer.json", b"{1: 2}"), ("tokenizer.json", b"\xff\xfe{}"),
                                           ("tokenizer_config.json", b"{not json"),
                                           ("tokenizer_config.json", b'{"a": "\xff"}'),
                                           ("chat_template.jinja", b"\xff{{ messages }}")])
def test_a_tokenizer_file_that_cannot_be_read_is_one_line_before_the_weights_load(tmp_path: Path, capsys, monkeypatch,
                                                                                   name, content) -> None:
    ckpt = write(tmp_path / "c", CFG.to_hf_config(), hf_tensors(CFG, seed=3))
    write_byte_tokenizer(ckpt)
    (ckpt / name).write_bytes(content)

    def no_engine(config):
        raise AssertionError("the weights were loaded before the tokenizer was read")
    monkeypatch.setattr(serve, "Engine", no_engine)
    assert serve.main(["--port", "0", "--device", "cpu", "--model", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache-serve: cannot read the tokenizer's") and str(ckpt / name) in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("where, fields", [
    ("config.json", {"eos_token_id": 512}), ("config.json", {"eos_token_id": [7, -1]}),
    ("config.json", {"attention_bias": True}),  # (refused as "unexpected tensors" only where biases were saved)
    ("config.json", {"rope_scaling": {"factor": 4.0}}),  # (no type: HF cannot run it; it loaded unscaled)
    ("generation_config.json", {"eos_token_id": [7, 600]}),
])
def test_config_values_a_qwen3_cannot_have_are_refused_at_the_load(tmp_path: Path, where, fields) -> None:
    from scheduler.loader import CheckpointError, load_checkpoint
    hf = CFG.to_hf_config()
    ckpt = write(tmp_path / "c", {**hf, **fields} if where == "config.json" else hf, hf_tensors(CFG, seed=3))
    if where != "config.json":
        (ckpt / where).write_text(json.dumps(fields))
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(ckpt, torch.device("cpu"), torch.float32)
    assert where in str(refused.value) and next(iter(fields)) in str(refused.value), refused.value


def test_max_position_embeddings_left_out_is_hf_qwen3s_default(tmp_path: Path) -> None:
    hf = {k: v for k, v in CFG.to_hf_config().items() if k != "max_position_embeddings"}
    assert model_config_of(str(write(tmp_path / "c", hf, hf_tensors(CFG, seed=3)))).max_position_embeddings == 32768


@pytest.mark.parametrize("denied", ["shard", "directory"])
def test_a_shard_or_directory_it_may_not_read_says_so(tmp_path: Path, monkeypatch, denied) -> None:
    """(As another user sees a mode-000 shard or a 0311 directory; these tests run as root, which reads anything, so
    the permission is what os.access answers.) It said "No such file or directory" of a shard that was there, and
    "has no *.safetensors file" of a directory it could not list."""
    import os

    from scheduler import loader
    ckpt = write(tmp_path / "c", CFG.to_hf_config(), hf_tensors(CFG, seed=3))
    target = ckpt / "model.safetensors" if denied == "shard" else ckpt
    real = os.access
    monkeypatch.setattr(loader.os, "access", lambda p, mode: Path(p) != target and real(p, mode))
    with pytest.raises(loader.CheckpointError, match="permission denied") as refused:
        loader.load_checkpoint(ckpt, torch.device("cpu"), torch.float32)
    assert str(target) in str(refused.value)

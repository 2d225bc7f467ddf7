"""A checkpoint directory's files read as transformers reads them (session 79's hunt): an error in
generation_config.json names that file, not config.json; a config.json the replay (or a simulated engine) cannot read
is named; use_sliding_window on without a sliding_window is HF Qwen3Config's default window of 4096, refused as any
window is (it was served as full attention, other answers than the model's)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scheduler.loader import CheckpointError, export_hf_state_dict, load_checkpoint
from scheduler.presets import ModelConfig, model_config_of
from test_loader import random_model, write_checkpoint

HF = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
      "num_attention_heads": 4}


@pytest.mark.parametrize("eos", ["x", 1.5, True])
def test_a_bad_eos_id_in_generation_config_names_that_file_not_config_json(tmp_path: Path, eos) -> None:
    src = random_model(tied=False)
    ckpt = write_checkpoint(tmp_path / "c", src.cfg, export_hf_state_dict(src))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, eos]}))
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(ckpt, "cpu", torch.float32)
    message = str(exc.value)
    # (regression: "…/generation_config.json: config.json's eos_token_id must be an integer", config.json being
    # right)
    assert message.startswith(f"{ckpt / 'generation_config.json'}: generation_config.json's eos_token_id must be "
                              "an integer, got "), message


def test_config_json_keeps_its_own_name_in_its_errors() -> None:
    with pytest.raises(ValueError, match="config.json's eos_token_id must be an integer, got 'x'"):
        ModelConfig.from_hf_config({**HF, "eos_token_id": "x"})


@pytest.mark.parametrize("content", ['{"vocab_size": 64,', '{"vocab_size": 64, "hidden_size": "\xe9"}'])
def test_a_config_json_the_shapes_cannot_be_read_from_is_named(tmp_path: Path, content: str) -> None:
    """model_config_of (the replay's tiers, a simulated engine): bad JSON, or bytes that are no UTF-8, named the
    file nowhere (regression: "hicache-replay: Expecting property name enclosed in double quotes: line 1 ...")."""
    (tmp_path / "config.json").write_bytes(content.encode("latin-1"))
    with pytest.raises(ValueError) as exc:
        model_config_of(str(tmp_path))
    assert str(tmp_path / "config.json") in str(exc.value), exc.value


def test_the_replay_names_a_malformed_config_json(tmp_path: Path, capsys) -> None:
    from scheduler.replay import run_cli
    (tmp_path / "config.json").write_text('{"vocab_size": 64,')
    with pytest.raises(SystemExit) as exit_:
        run_cli(["--model", str(tmp_path), "--simulate"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "config.json") in err and "Traceback" not in err, err


def test_a_sliding_window_switched_on_without_its_size_is_qwen3configs_4096() -> None:
    """HF Qwen3Config's sliding_window defaults to 4096: use_sliding_window true without the key is a window of 4096
    tokens, refused as any window is (regression: served as full attention, past 4096 tokens other answers than
    transformers'). An explicit null is no window (test_mutation_presets_s62)."""
    with pytest.raises(ValueError, match="sliding-window attention is not supported.*sliding_window=4096"):
        ModelConfig.from_hf_config({**HF, "use_sliding_window": True})
    assert ModelConfig.from_hf_config({**HF, "use_sliding_window": True, "sliding_window": None}).num_layers == 2
    assert ModelConfig.from_hf_config({**HF, "use_sliding_window": False}).num_layers == 2

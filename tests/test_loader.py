"""Checkpoint loading: a tiny HF-named checkpoint written here, loaded back, same logits."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from scheduler.loader import CheckpointError, checkpoint_identity, export_hf_state_dict, load_checkpoint
from scheduler.model import Qwen3Model, init_random_weights, load_model
from scheduler.presets import PRESETS, ModelConfig

CPU = torch.device("cpu")


def random_model(tied: bool, seed: int = 0) -> Qwen3Model:
    cfg = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=tied, eos_token_id=7)
    return init_random_weights(Qwen3Model.empty(cfg, CPU, torch.float32), seed)


def write_checkpoint(path: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    names = sorted(tensors)
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / (f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1
                                    else "model.safetensors")))
    return path


def logits(model: Qwen3Model) -> torch.Tensor:
    ids = torch.randint(0, model.cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model.forward_dense(ids)


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_gives_same_logits(tmp_path: Path, tied: bool) -> None:
    src = random_model(tied)
    tensors = export_hf_state_dict(src)
    assert ("lm_head.weight" in tensors) != tied
    assert "model.layers.1.self_attn.k_proj.weight" in tensors and "model.layers.0.mlp.up_proj.weight" in tensors
    ckpt = write_checkpoint(tmp_path / "ckpt", src.cfg, tensors)
    model, cfg, ident = load_checkpoint(ckpt, CPU, torch.float32)
    assert cfg == src.cfg and cfg.eos_token_id == 7 and ident.startswith("ckpt:")
    assert (model.lm_head is None) == tied
    torch.testing.assert_close(logits(model), logits(src), rtol=0, atol=0)


def test_sharded_checkpoint_through_load_model(tmp_path: Path) -> None:
    src = random_model(False, seed=1)
    ckpt = write_checkpoint(tmp_path / "ckpt", src.cfg, export_hf_state_dict(src), shards=3)
    model, cfg, ident = load_model(str(ckpt), CPU, torch.float32, seed=0)
    assert ident == checkpoint_identity(ckpt)
    torch.testing.assert_close(logits(model), logits(src), rtol=0, atol=0)
    half, _, _ = load_model(str(ckpt), CPU, torch.bfloat16, seed=0)
    assert half.layers[0].qkv_proj.weight.dtype == torch.bfloat16


def test_tied_checkpoint_may_carry_lm_head(tmp_path: Path) -> None:
    src = random_model(True)
    tensors = export_hf_state_dict(src)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    model, _, _ = load_checkpoint(write_checkpoint(tmp_path / "c", src.cfg, tensors), CPU, torch.float32)
    torch.testing.assert_close(logits(model), logits(src), rtol=0, atol=0)


def test_identity_depends_on_config_and_files(tmp_path: Path) -> None:
    src = random_model(False)
    a = write_checkpoint(tmp_path / "a", src.cfg, export_hf_state_dict(src))
    b = write_checkpoint(tmp_path / "b", src.cfg, export_hf_state_dict(src))
    c = write_checkpoint(tmp_path / "c", dataclasses.replace(src.cfg, rope_theta=5e5), export_hf_state_dict(src))
    assert checkpoint_identity(a) == checkpoint_identity(b) != checkpoint_identity(c)


def test_identity_depends_on_the_weights_not_only_their_shapes(tmp_path: Path) -> None:
    """A fine-tune has its base's config, file names and sizes: with those alone both models had one
    identity, hence one set of shared-L3 keys, and one restored the other's KV."""
    base = random_model(False)
    tensors = export_hf_state_dict(base)
    a = write_checkpoint(tmp_path / "base", base.cfg, tensors)
    tuned = dict(tensors)
    tuned["model.norm.weight"] = tuned["model.norm.weight"] + 1e-3  # one small tensor changed
    b = write_checkpoint(tmp_path / "tuned", base.cfg, tuned)
    assert sorted(p.stat().st_size for p in a.glob("*")) == sorted(p.stat().st_size for p in b.glob("*"))
    assert checkpoint_identity(a) != checkpoint_identity(b)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    src = random_model(False)
    tensors = export_hf_state_dict(src)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(CheckpointError, match=r"lacks tensors.*layers\.1\.self_attn\.v_proj"):
        load_checkpoint(write_checkpoint(tmp_path / "c", src.cfg, tensors), CPU, torch.float32)


def test_untied_without_lm_head_is_an_error(tmp_path: Path) -> None:
    src = random_model(False)
    tensors = export_hf_state_dict(src)
    del tensors["lm_head.weight"]
    with pytest.raises(CheckpointError, match="tie_word_embeddings=false"):
        load_checkpoint(write_checkpoint(tmp_path / "c", src.cfg, tensors), CPU, torch.float32)


def test_unexpected_and_misshaped_tensors(tmp_path: Path) -> None:
    src = random_model(False)
    tensors = export_hf_state_dict(src)
    extra = {**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(4)}
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*q_proj\.bias"):
        load_checkpoint(write_checkpoint(tmp_path / "extra", src.cfg, extra), CPU, torch.float32)
    bad = {**tensors, "model.norm.weight": torch.ones(3)}
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*shape \(3,\).*\(64,\)"):
        load_checkpoint(write_checkpoint(tmp_path / "bad", src.cfg, bad), CPU, torch.float32)
    ignored = {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    load_checkpoint(write_checkpoint(tmp_path / "ok", src.cfg, ignored), CPU, torch.float32)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path, CPU, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_config()))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(tmp_path, CPU, torch.float32)


def test_generation_configs_end_tokens_stop_a_generation(tmp_path: Path) -> None:
    """Only config.json's first end id stopped a generation: an end token listed in
    generation_config.json (Qwen3's <|endoftext|>) ran on, its text hidden, to max_tokens."""
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.request import SamplingParams

    src = random_model(False)
    ckpt = write_checkpoint(tmp_path / "c", src.cfg, export_hf_state_dict(src))
    prompt, params = [[1, 2, 3, 4]], SamplingParams(max_tokens=6)
    first = Engine(EngineConfig(model=str(ckpt), device="cpu", num_pages=64)).generate(prompt, params)[0]
    assert first.finish_reason == "length" and first.output_ids[0] != 7  # (7: config.json's end id)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, first.output_ids[0]]}))
    eng = Engine(EngineConfig(model=str(ckpt), device="cpu", num_pages=64))
    assert eng.model_config.eos_token_ids == (7, first.output_ids[0])
    [stopped] = eng.generate(prompt, params)
    assert stopped.finish_reason == "stop" and stopped.output_ids == first.output_ids[:1]

"""Checkpoint loader edge cases: configs and files a real Qwen3 directory may carry, each either loaded
as HF would load it or refused with a CheckpointError naming the problem (never loaded as garbage)."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from scheduler.loader import CheckpointError, checkpoint_identity, export_hf_state_dict, load_checkpoint
from scheduler.model import Qwen3Model, init_random_weights
from scheduler.presets import PRESETS, ModelConfig

CPU = torch.device("cpu")


def random_model(tied: bool = False, seed: int = 0, **changes) -> Qwen3Model:
    cfg = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=tied, eos_token_id=7, **changes)
    return init_random_weights(Qwen3Model.empty(cfg, CPU, torch.float32), seed)


def write(path: Path, hf_config: dict, tensors: dict[str, torch.Tensor], shards: int = 1,
          index: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def ids() -> torch.Tensor:
    return torch.randint(0, PRESETS["tiny"].vocab_size, (11,), generator=torch.Generator().manual_seed(5))


def logits(model: Qwen3Model) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_dense(ids())


def hf_reference_logits(t: dict[str, torch.Tensor], cfg: ModelConfig, input_ids: torch.Tensor) -> torch.Tensor:
    """Qwen3ForCausalLM's forward written from HF's modeling_qwen3 on the HF tensor names, separate
    q/k/v and gate/up projections (nothing shared with scheduler/model.py or the loader's name map)."""
    n, d, eps = input_ids.shape[0], cfg.head_dim, cfg.rms_norm_eps

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rot(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)

    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos()[:, None], torch.cat((freqs, freqs), -1).sin()[:, None]
    x = t["model.embed_tokens.weight"][input_ids].float()
    group = cfg.num_heads // cfg.num_kv_heads
    mask = torch.full((n, n), float("-inf")).triu(1)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q = rms((h @ t[p + "self_attn.q_proj.weight"].T).view(n, cfg.num_heads, d), t[p + "self_attn.q_norm.weight"])
        k = rms((h @ t[p + "self_attn.k_proj.weight"].T).view(n, cfg.num_kv_heads, d), t[p + "self_attn.k_norm.weight"])
        v = (h @ t[p + "self_attn.v_proj.weight"].T).view(n, cfg.num_kv_heads, d)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d) + mask
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        x = x + o @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)) \
            @ t[p + "mlp.down_proj.weight"].T
    head = t["model.embed_tokens.weight"] if cfg.tie_word_embeddings else t["lm_head.weight"]
    return rms(x, t["model.norm.weight"]) @ head.T


def hf_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors under HF names, drawn per name (no fused buffer), norms away from 1."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv, inter, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = 1.0 + 0.5 * torch.randn(shape, generator=gen)
        else:
            out[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1] if "embed" not in name else 1)
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loaded_model_matches_an_independent_hf_reference(tmp_path: Path, tied: bool,
                                                           file_dtype: torch.dtype) -> None:
    """The round-trip tests use the loader's own name map both ways, so a q/k/v or gate/up swap in
    it would pass them: here the reference reads the HF names directly."""
    cfg = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=tied, rope_theta=1e6)
    tensors = {n: t.to(file_dtype) for n, t in hf_tensors(cfg, seed=3).items()}
    ckpt = write(tmp_path / "c", cfg.to_hf_config(), tensors, shards=2, index=True)
    model, _, _ = load_checkpoint(ckpt, CPU, torch.float32)
    ref = hf_reference_logits({n: t.float() for n, t in tensors.items()}, cfg, ids())
    torch.testing.assert_close(logits(model), ref, rtol=1e-4, atol=1e-4)


def _config_with(cfg: ModelConfig, **fields) -> dict:
    return {**cfg.to_hf_config(), **fields}


@pytest.mark.parametrize("field,value", [
    ("tie_word_embeddings", "false"),  # bool("false") is True: the untied lm_head was skipped
    ("tie_word_embeddings", 0),
    ("num_hidden_layers", 2.7),  # int(2.7) == 2
    ("num_hidden_layers", True),
    ("hidden_size", "64"),
    ("rms_norm_eps", "1e-6"),
    ("rope_theta", True),
    ("eos_token_id", 7.5),
    ("num_hidden_layers", float("inf")),  # int(inf) raised OverflowError, not a CheckpointError
    ("rope_theta", float("nan")),
    ("rope_theta", 0),
])
def test_config_field_of_the_wrong_type_is_named(tmp_path: Path, field: str, value) -> None:
    src = random_model()
    ckpt = write(tmp_path / "c", _config_with(src.cfg, **{field: value}), export_hf_state_dict(src))
    with pytest.raises(CheckpointError, match=field):
        load_checkpoint(ckpt, CPU, torch.float32)


def test_integral_floats_in_config_are_accepted(tmp_path: Path) -> None:
    src = random_model()
    hf = _config_with(src.cfg, num_hidden_layers=2.0, hidden_size=64.0, rope_theta=10000)
    model, cfg, _ = load_checkpoint(write(tmp_path / "c", hf, export_hf_state_dict(src)), CPU, torch.float32)
    assert cfg == src.cfg
    torch.testing.assert_close(logits(model), logits(src), rtol=0, atol=0)


def test_transformers_v5_rope_parameters_give_rope_theta(tmp_path: Path) -> None:
    """transformers 5 writes rope_theta inside "rope_parameters"; the loader took the 10000 default
    instead (Qwen3's is 1e6) and every position past 0 was rotated wrongly."""
    src = random_model(rope_theta=1e6)
    hf = src.cfg.to_hf_config()
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": hf.pop("rope_theta")}
    model, cfg, _ = load_checkpoint(write(tmp_path / "c", hf, export_hf_state_dict(src)), CPU, torch.float32)
    assert cfg.rope_theta == 1e6
    torch.testing.assert_close(logits(model), logits(src), rtol=0, atol=0)


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                         "original_max_position_embeddings": 32768}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 5e5},  # two thetas
])
def test_unsupported_or_conflicting_rope_parameters_are_refused(tmp_path: Path, rope: dict) -> None:
    src = random_model(rope_theta=1e6)
    hf = {k: v for k, v in src.cfg.to_hf_config().items() if k != "rope_theta"}
    with pytest.raises(CheckpointError, match="rope"):
        load_checkpoint(write(tmp_path / "c", {**hf, **rope}, export_hf_state_dict(src)), CPU, torch.float32)


def test_default_rope_scaling_entry_is_not_scaling(tmp_path: Path) -> None:
    src = random_model(rope_theta=1e6)
    hf = _config_with(src.cfg, rope_scaling={"rope_type": "default"})
    model, cfg, _ = load_checkpoint(write(tmp_path / "c", hf, export_hf_state_dict(src)), CPU, torch.float32)
    assert cfg.rope_theta == 1e6


@pytest.mark.parametrize("fields", [{"hidden_act": "gelu"}, {"use_sliding_window": True, "sliding_window": 4}])
def test_config_values_the_model_does_not_implement_are_refused(tmp_path: Path, fields: dict) -> None:
    src = random_model()
    ckpt = write(tmp_path / "c", _config_with(src.cfg, **fields), export_hf_state_dict(src))
    with pytest.raises(CheckpointError, match=next(iter(fields))):
        load_checkpoint(ckpt, CPU, torch.float32)


def test_missing_head_dim_takes_qwen3s_default_of_128(tmp_path: Path) -> None:
    """HF's Qwen3Config defaults head_dim to 128, not hidden_size // num_attention_heads."""
    src = random_model(head_dim=128)
    hf = {k: v for k, v in src.cfg.to_hf_config().items() if k != "head_dim"}
    model, cfg, _ = load_checkpoint(write(tmp_path / "c", hf, export_hf_state_dict(src)), CPU, torch.float32)
    assert cfg.head_dim == 128
    torch.testing.assert_close(logits(model), logits(src), rtol=0, atol=0)


@pytest.mark.parametrize("text", ["[1, 2]", "null", "\"qwen3\""])
def test_config_json_that_is_not_an_object(tmp_path: Path, text: str) -> None:
    src = random_model()
    ckpt = write(tmp_path / "c", {}, export_hf_state_dict(src))
    (ckpt / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(ckpt, CPU, torch.float32)


@pytest.mark.parametrize("text", ["{bad", "[7]", "{\"eos_token_id\": \"x\"}"])
def test_bad_generation_config_is_named(tmp_path: Path, text: str) -> None:
    src = random_model()
    ckpt = write(tmp_path / "c", src.cfg.to_hf_config(), export_hf_state_dict(src))
    (ckpt / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_checkpoint(ckpt, CPU, torch.float32)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "directory", "dangling_link"])
def test_unreadable_shard_is_named(tmp_path: Path, damage: str) -> None:
    src = random_model()
    ckpt = write(tmp_path / "c", src.cfg.to_hf_config(), export_hf_state_dict(src), shards=2)
    shard = ckpt / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[:len(data) // 2])
    elif damage == "garbage":
        shard.write_bytes(b"not a safetensors file")
    elif damage == "empty":
        shard.write_bytes(b"")
    else:
        shard.unlink()
        if damage == "directory":
            shard.mkdir()
        else:
            shard.symlink_to(tmp_path / "blob-never-downloaded")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_checkpoint(ckpt, CPU, torch.float32)


def test_truncated_tensor_data_is_named(tmp_path: Path) -> None:
    """A header that parses, data cut short (an interrupted copy)."""
    src = random_model()
    ckpt = write(tmp_path / "c", src.cfg.to_hf_config(), export_hf_state_dict(src))
    shard = ckpt / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(ckpt, CPU, torch.float32)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8, torch.float8_e4m3fn, torch.bool])
def test_non_floating_or_fp8_tensor_is_refused(tmp_path: Path, dtype: torch.dtype) -> None:
    """A quantized tensor (int8, fp8) was cast to the model dtype as if it held real values."""
    src = random_model()
    tensors = export_hf_state_dict(src)
    w = tensors["model.layers.0.mlp.down_proj.weight"]
    tensors["model.layers.0.mlp.down_proj.weight"] = (w * 100).clamp(-100, 100).to(dtype)
    ckpt = write(tmp_path / "c", src.cfg.to_hf_config(), tensors)
    with pytest.raises(CheckpointError, match=r"down_proj.*dtype"):
        load_checkpoint(ckpt, CPU, torch.float32)


def test_index_names_a_shard_that_is_missing(tmp_path: Path) -> None:
    src = random_model()
    ckpt = write(tmp_path / "c", src.cfg.to_hf_config(), export_hf_state_dict(src), shards=3, index=True)
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        load_checkpoint(ckpt, CPU, torch.float32)


def test_index_decides_which_files_are_the_checkpoint(tmp_path: Path) -> None:
    """As in HF: with an index, a stray safetensors file beside the shards (an adapter, an older
    consolidated copy) is not part of the model, for the weights nor for the identity."""
    src = random_model()
    tensors = export_hf_state_dict(src)
    ckpt = write(tmp_path / "c", src.cfg.to_hf_config(), tensors, shards=2, index=True)
    ident = checkpoint_identity(ckpt)
    save_file({"base_model.model.lora_A.weight": torch.zeros(2, 2)}, str(ckpt / "adapter_model.safetensors"))
    save_file({"model.norm.weight": torch.zeros(64)}, str(ckpt / "model.safetensors"))  # stale copy
    model, _, ident2 = load_checkpoint(ckpt, CPU, torch.float32)
    torch.testing.assert_close(logits(model), logits(src), rtol=0, atol=0)
    assert ident2 == ident


@pytest.mark.parametrize("text", ["{bad", "{\"weight_map\": [1]}", "{}"])
def test_bad_index_is_named(tmp_path: Path, text: str) -> None:
    src = random_model()
    ckpt = write(tmp_path / "c", src.cfg.to_hf_config(), export_hf_state_dict(src), shards=2)
    (ckpt / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match="index.json"):
        load_checkpoint(ckpt, CPU, torch.float32)


def test_identity_changes_with_one_byte_of_any_shard(tmp_path: Path) -> None:
    src = random_model()
    ckpt = write(tmp_path / "c", src.cfg.to_hf_config(), export_hf_state_dict(src), shards=3, index=True)
    before = checkpoint_identity(ckpt)
    shard = ckpt / "model-00003-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1  # one bit of the last tensor's data
    shard.write_bytes(bytes(data))
    assert checkpoint_identity(ckpt, chunk_bytes=1000) != before
    with safe_open(str(shard), "pt") as f:  # still a readable file of the same names
        assert set(f.keys())

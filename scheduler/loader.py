"""Load a local HF Qwen3 checkpoint directory (config.json + *.safetensors) into Qwen3Model.

HF tensor names map onto views of the model's (partly fused) parameters: q/k/v_proj are row slices of
qkv_proj, gate/up_proj row slices of gate_up_proj. The same map exports a model under HF names.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError, safe_open

from scheduler.model import Qwen3Model
from scheduler.presets import ModelConfig, config_token_ids

# tensors some checkpoints carry that carry no weights we need
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# dtypes whose values are the weights themselves (int8 / fp8 ones are quantized: they need scales)
_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded into Qwen3Model (names, shapes, files)."""


def hf_param_map(model: Qwen3Model) -> dict[str, torch.Tensor]:
    """HF name -> a view into the model parameter that holds it (writes through to the model)."""
    cfg = model.cfg
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed_tokens.weight,
                                    "model.norm.weight": model.norm.weight}
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head.weight
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = layer.qkv_proj.weight  # [q + 2 kv, H]
        gate_up = layer.gate_up_proj.weight  # [2 I, H]
        out.update({
            p + "self_attn.q_proj.weight": qkv[:q],
            p + "self_attn.k_proj.weight": qkv[q:q + kv],
            p + "self_attn.v_proj.weight": qkv[q + kv:],
            p + "self_attn.o_proj.weight": layer.o_proj.weight,
            p + "self_attn.q_norm.weight": layer.q_norm.weight,
            p + "self_attn.k_norm.weight": layer.k_norm.weight,
            p + "mlp.gate_proj.weight": gate_up[:inter],
            p + "mlp.up_proj.weight": gate_up[inter:],
            p + "mlp.down_proj.weight": layer.down_proj.weight,
            p + "input_layernorm.weight": layer.input_layernorm.weight,
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        })
    return out


def export_hf_state_dict(model: Qwen3Model) -> dict[str, torch.Tensor]:
    """The model's weights under HF names, as contiguous CPU tensors (for writing a checkpoint)."""
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in hf_param_map(model).items()}


def _files(path: Path) -> tuple[Path, list[Path]]:
    """(config.json, the safetensors files). With model.safetensors.index.json, as in HF, the files its
    weight_map names (each must be there; other *.safetensors beside them are not the model's)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is not a directory")
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no config.json")
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a readable safetensors index ({e})") from e
        if not isinstance(weight_map, dict) or not weight_map or \
                not all(isinstance(f, str) and f and Path(f).name == f for f in weight_map.values()):
            raise CheckpointError(f"{index}: its weight_map must map tensor names to file names in the directory")
        shards = [path / name for name in sorted(set(weight_map.values()))]
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise CheckpointError(f"checkpoint {str(path)!r} lacks {_names(absent)}, named in {INDEX_FILE}")
        return config, shards
    if not os.access(path, os.R_OK):  # (glob finds nothing in a directory it cannot list: "has no file")
        raise CheckpointError(f"checkpoint {str(path)!r}: cannot list the directory (permission denied)")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"checkpoint {str(path)!r} has no *.safetensors file")
    return config, shards


def checkpoint_identity(path: str | Path, chunk_bytes: int = 16 << 20) -> str:
    """"ckpt:" + digest of config.json and of every safetensors file's name and bytes. The bytes,
    not the sizes: a fine-tune has its base model's config and shapes, and with the sizes alone the
    two shared L3 keys, so one restored the other's KV (outputs differed from its own recompute).
    xxh3-128 at ~10 GB/s, over files the load has just read: ~2 s for an 8B checkpoint."""
    config, shards = _files(Path(path))
    h = hashlib.sha256(config.read_bytes())
    for shard in shards:
        content = xxhash.xxh3_128()
        try:
            with open(shard, "rb") as f:
                while block := f.read(chunk_bytes):
                    content.update(block)
        except OSError as e:
            raise CheckpointError(f"cannot read {shard}: {e}") from e
        h.update(f"\0{shard.name}\0{shard.stat().st_size}\0{content.hexdigest()}".encode())
    return "ckpt:" + h.hexdigest()[:16]


def _with_generation_eos(cfg: ModelConfig, path: Path) -> ModelConfig:
    """generation_config.json's end-of-sequence ids stop a generation too, as in HF's generate()
    (Qwen3's lists <|endoftext|> there; config.json may name only <|im_end|>)."""
    gen = path / "generation_config.json"
    if not gen.is_file():
        return cfg
    try:
        data = json.loads(gen.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"must hold a JSON object, not {type(data).__name__}")
        ids = config_token_ids(data.get("eos_token_id"), "eos_token_id", cfg.vocab_size, gen.name)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{gen}: {e}") from e
    extra = tuple(i for i in ids if i not in cfg.eos_token_ids)
    if cfg.eos_token_id is None and extra:
        return dataclasses.replace(cfg, eos_token_id=extra[0], extra_eos_token_ids=extra[1:])
    return dataclasses.replace(cfg, extra_eos_token_ids=cfg.extra_eos_token_ids + extra)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


@torch.no_grad()
def load_checkpoint(path: str | Path, device: torch.device | str,
                    dtype: torch.dtype) -> tuple[Qwen3Model, ModelConfig, str]:
    """-> (model on `device` in `dtype`, its config, identity). Raises CheckpointError on any mismatch."""
    path = Path(path)
    config_file, shards = _files(path)
    try:
        cfg = ModelConfig.from_hf_config(json.loads(config_file.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{config_file}: {e}") from e
    cfg = _with_generation_eos(cfg, path)
    model = Qwen3Model.empty(cfg, device, dtype)  # uninitialised: every tensor must come from the files
    targets = hf_param_map(model)
    loaded: dict[str, Path] = {}
    unexpected: list[str] = []
    for shard in shards:
        if shard.is_file() and not os.access(shard, os.R_OK):  # (safetensors says "No such file or directory")
            raise CheckpointError(f"cannot read {shard}: permission denied")
        try:
            _load_shard(shard, cfg, targets, loaded, unexpected)
        except (SafetensorError, OSError) as e:  # not a safetensors file, truncated, unreadable
            raise CheckpointError(f"cannot read {shard}: {e}") from e
    if unexpected:
        raise CheckpointError(f"checkpoint {str(path)!r} has unexpected tensors: {_names(unexpected)}")
    missing = [name for name in targets if name not in loaded]
    if missing:
        hint = " (config.json says tie_word_embeddings=false)" if missing == ["lm_head.weight"] else ""
        raise CheckpointError(f"checkpoint {str(path)!r} lacks tensors{hint}: {_names(missing)}")
    return model, cfg, checkpoint_identity(path)


@torch.no_grad()
def _load_shard(shard: Path, cfg: ModelConfig, targets: dict[str, torch.Tensor], loaded: dict[str, Path],
                unexpected: list[str]) -> None:
    """Copy one file's tensors into their targets; records them in `loaded`, strangers in `unexpected`."""
    with safe_open(str(shard), framework="pt", device="cpu") as f:
        for name in f.keys():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: the head is the embedding, as in HF
            if name not in targets:
                unexpected.append(f"{name} ({shard.name})")
                continue
            if name in loaded:
                raise CheckpointError(f"tensor {name} appears in both {loaded[name].name} and {shard.name}")
            tensor = f.get_tensor(name)
            target = targets[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"tensor {name} in {shard.name} has shape {tuple(tensor.shape)}, "
                                      f"config.json implies {tuple(target.shape)}")
            if tensor.dtype not in _WEIGHT_DTYPES:
                raise CheckpointError(f"tensor {name} in {shard.name} has dtype {tensor.dtype} (quantized?); "
                                      f"only float16, bfloat16 and float32 weights load")
            target.copy_(tensor)  # casts to dtype, moves to device
            loaded[name] = shard

"""Qwen3 model shapes: a frozen ModelConfig, built from a HF config.json or taken from a preset.

Presets carry the real shapes of Qwen3-0.6B / 4B / 8B (weights are seeded random: nothing can be
downloaded here, and restore-vs-recompute costs depend only on shapes) plus `tiny` for CPU tests.
Random-weight presets have `eos_token_id=None` on purpose: a random model would hit a real EOS id at
an arbitrary step, so generations run to their max_new_tokens and lengths stay predictable.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from hicache.geometry import KVGeometry

# HF Qwen3Config's sliding_window where config.json has none (with use_sliding_window true, a window)
QWEN3_SLIDING_WINDOW = 4096


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_id: int | None
    # further end-of-sequence ids: the rest of a config.json list, and generation_config.json's
    extra_eos_token_ids: tuple[int, ...] = ()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation (unless the request ignores EOS)."""
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return tuple(dict.fromkeys(first + self.extra_eos_token_ids))

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:  # elements of one token's queries
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:  # elements of one token's keys (or values)
        return self.num_kv_heads * self.head_dim

    def kv_geometry(self, page_size: int, dtype: torch.dtype) -> KVGeometry:
        return KVGeometry(self.num_layers, self.num_kv_heads, self.head_dim, page_size, dtype)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.kv_geometry(1, dtype).bytes_per_token

    def num_params(self) -> int:
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        per_layer = h * (q + 2 * kv) + q * h + 2 * self.head_dim + 2 * h + 3 * h * i
        heads = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + heads + h

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a HF Qwen3 config.json dict; missing optional keys take HF Qwen3Config's defaults
        (max_position_embeddings 32,768), but for num_key_value_heads: absent, as null, the attention heads' (HF's
        32 would not divide most of them). End-of-sequence ids must be within the vocabulary.

        Values must have their JSON types (an integer, a number, true/false): a string "false" read as
        Python's bool("false") tied an untied model's head, a 2.7 was truncated, a bool taken for 1.
        Settings the model does not implement are refused, not ignored (hidden_act, sliding window,
        RoPE scaling); rope_theta is also read from transformers 5's "rope_parameters"."""
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json must hold a JSON object, not {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type not in (None, "qwen3"):
            raise ValueError(f"only the Qwen3 architecture is supported, config.json says model_type={model_type!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"only hidden_act 'silu' is supported, config.json says {cfg['hidden_act']!r}")
        if _flag(cfg, "attention_bias", False):  # (refused here, not as "unexpected tensors" at the load)
            raise ValueError("attention biases are not supported, config.json has attention_bias=true")
        # (absent, Qwen3Config's default window of 4096: regression, served as full attention; null is none)
        window = cfg.get("sliding_window", QWEN3_SLIDING_WINDOW)
        if _flag(cfg, "use_sliding_window", False) and window is not None:
            absent = "" if "sliding_window" in cfg else " (absent: Qwen3Config's default)"
            raise ValueError(f"sliding-window attention is not supported, config.json has use_sliding_window=true "
                             f"and sliding_window={window!r}{absent}")
        rope_theta = _rope_theta(cfg)

        def need(key: str) -> Any:
            if key not in cfg:
                raise ValueError(f"config.json lacks required key {key!r}")
            return cfg[key]

        num_heads = _int(need("num_attention_heads"), "num_attention_heads")
        vocab_size = _int(need("vocab_size"), "vocab_size")
        eos_ids = config_token_ids(cfg.get("eos_token_id"), "eos_token_id", vocab_size)
        hidden = _int(need("hidden_size"), "hidden_size")
        # absent: Qwen3Config's default, 128 (not hidden // heads); null: what that would be without heads
        kv_heads, head_dim = cfg.get("num_key_value_heads"), cfg.get("head_dim", 128)
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=_int(need("intermediate_size"), "intermediate_size"),
            num_layers=_int(need("num_hidden_layers"), "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_heads if kv_heads is None else _int(kv_heads, "num_key_value_heads"),
            head_dim=hidden // num_heads if head_dim is None else _int(head_dim, "head_dim"),
            rope_theta=rope_theta,
            rms_norm_eps=_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            tie_word_embeddings=_flag(cfg, "tie_word_embeddings", False),
            max_position_embeddings=_int(cfg.get("max_position_embeddings", 32768), "max_position_embeddings"),
            eos_token_id=eos_ids[0] if eos_ids else None,
            extra_eos_token_ids=tuple(eos_ids[1:]),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json dict a HF Qwen3 checkpoint of these shapes would carry."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "eos_token_id": list(self.eos_token_ids) if self.extra_eos_token_ids else self.eos_token_id,
            "hidden_act": "silu",
            "attention_bias": False,
        }


def _int(value: Any, key: str, source: str = "config.json") -> int:
    """A config.json integer (an integral float such as 64.0 too); never a bool, string or fraction."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value):
        raise ValueError(f"{source}'s {key} must be an integer, got {value!r}")
    return int(value)


def _float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"config.json's {key} must be a (finite) number, got {value!r}")
    return float(value)


def _flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config.json's {key} must be true or false, got {value!r}")
    return value


def config_token_ids(value: Any, key: str, vocab_size: int, source: str = "config.json") -> list[int]:
    """An end-token id, a list of them, or null -> the ids, each within [0, vocab_size) (regression: an id past the
    vocabulary loaded, then every structured-output request was a 400 naming the tokenizer). source: the file the
    value is from (generation_config.json's too: regression, its errors said config.json)."""
    values = value if isinstance(value, (list, tuple)) else ([] if value is None else [value])
    ids = [_int(v, key, source) for v in values]
    if outside := [i for i in ids if not 0 <= i < vocab_size]:
        raise ValueError(f"{key} {outside[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def _rope_theta(cfg: dict[str, Any]) -> float:
    """rope_theta of a config.json: top-level (transformers 4) or in "rope_parameters" (transformers 5).
    Any RoPE type other than "default" (yarn, linear, dynamic, ...) is a scaling this model lacks."""
    theta = cfg.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        if not rope:  # null, {}: no scaling
            continue
        if not isinstance(rope, dict):
            raise ValueError(f"config.json's {key} must be an object, got {rope!r}")
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"RoPE scaling is not supported, config.json has {key}={rope!r}")
        if "factor" in rope and "rope_type" not in rope and "type" not in rope:  # (HF cannot run it: not unscaled)
            raise ValueError(f"config.json's {key} has a factor but no rope_type: {rope!r}")
        if rope.get("rope_theta") is not None:
            if theta is not None and _float(rope["rope_theta"], key) != _float(theta, "rope_theta"):
                raise ValueError(f"config.json has rope_theta={theta!r} and {key}.rope_theta="
                                 f"{rope['rope_theta']!r}")
            theta = rope["rope_theta"]
    theta = _float(10000.0 if theta is None else theta, "rope_theta")
    if theta <= 0:
        raise ValueError(f"config.json's rope_theta must be > 0, got {theta!r}")
    return theta


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=tied, max_position_embeddings=40960,
                       eos_token_id=None)  # random weights: never stop early (module docstring)


PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": _qwen3(hidden=1024, inter=3072, layers=28, heads=16, tied=True),
    "qwen3-4b": _qwen3(hidden=2560, inter=9728, layers=36, heads=32, tied=True),
    "qwen3-8b": _qwen3(hidden=4096, inter=12288, layers=36, heads=32, tied=False),
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, max_position_embeddings=4096, eos_token_id=None),
}


def is_preset(name: str) -> bool:
    """Whether `--model name` means a preset: a name of one, unless a checkpoint directory of that name is there (its
    config.json), which wins, as vLLM takes an existing local path (regression: `--model qwen3-0.6b` beside a
    download of that name loaded random weights, with the directory's tokenizer)."""
    return name in PRESETS and not os.path.isfile(os.path.join(name, "config.json"))


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}") from None


def model_config_of(name_or_path: str) -> ModelConfig:
    """The shapes of a preset or of a checkpoint's config.json, without loading weights."""
    if is_preset(name_or_path):
        return PRESETS[name_or_path]
    path = os.path.join(name_or_path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint dir")
    try:  # (UTF-8, as transformers reads it; regression: a malformed file's error named no file)
        with open(path, encoding="utf-8") as f:
            return ModelConfig.from_hf_config(json.load(f))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e

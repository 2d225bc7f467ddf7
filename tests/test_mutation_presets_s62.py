"""Session 62's mutation check of scheduler/presets.py (and one of hicache/config.py's bounds): a checkpoint's
config.json read as HF's Qwen3Config reads it (its defaults for absent keys), the shape checks, and the parameter
count the memory plan sizes weights by, exact against the model's own parameters. No weights loaded beyond the tiny
preset's."""
from __future__ import annotations

import dataclasses

import pytest

from scheduler.model import Qwen3Model
from scheduler.presets import ModelConfig, get_preset

TINY = get_preset("tiny")
HF = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
      "num_attention_heads": 4}


@pytest.mark.parametrize("tied", [False, True])
def test_num_params_is_the_models_own_count(tied):
    """Each layer's q/k norms (head_dim each), its two RMSNorms, the final norm and an untied head all counted
    (within 1 % of the released models' counts, test_model, a dropped q/k norm or final norm still passed)."""
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied)
    assert cfg.num_params() == sum(p.numel() for p in Qwen3Model(cfg).parameters())


def test_the_eos_ids_keep_their_order_once_each():
    cfg = dataclasses.replace(TINY, eos_token_id=5, extra_eos_token_ids=(7, 5, 3, 7))
    assert cfg.eos_token_ids == (5, 7, 3)


@pytest.mark.parametrize("field", ["num_kv_heads", "head_dim", "num_layers"])
def test_a_shape_of_0_is_refused_by_name(field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field} must be >= 1, got 0"):
        dataclasses.replace(TINY, **{field: 0})


def test_heads_that_do_not_share_kv_heads_evenly_or_an_odd_head_dim_are_refused():
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        dataclasses.replace(TINY, num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="head_dim must be even for RoPE, got 15"):
        dataclasses.replace(TINY, head_dim=15)


def test_absent_keys_take_qwen3configs_defaults():
    """HF Qwen3Config's defaults: head_dim 128 (not hidden // heads), the kv heads the attention heads', eps 1e-6,
    an untied head, 32,768 positions; no model_type is read as Qwen3 (older exports)."""
    cfg = ModelConfig.from_hf_config({k: v for k, v in HF.items() if k != "model_type"})
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rms_norm_eps, cfg.tie_word_embeddings,
            cfg.max_position_embeddings) == (128, 4, 1e-6, False, 32768)
    assert ModelConfig.from_hf_config({**HF, "head_dim": None}).head_dim == 8  # (null: hidden // heads)


def test_every_eos_id_of_a_list_is_kept_and_written_back():
    cfg = ModelConfig.from_hf_config({**HF, "eos_token_id": [3, 9, 4]})
    assert cfg.eos_token_ids == (3, 9, 4)
    assert cfg.to_hf_config()["eos_token_id"] == [3, 9, 4]
    assert ModelConfig.from_hf_config({**HF, "eos_token_id": 3}).to_hf_config()["eos_token_id"] == 3


def test_a_sliding_window_switched_on_without_a_size_is_served():
    """use_sliding_window true with sliding_window null is no window (as transformers reads it): served; with a size,
    refused."""
    assert ModelConfig.from_hf_config({**HF, "use_sliding_window": True, "sliding_window": None}).num_layers == 2
    with pytest.raises(ValueError, match="sliding-window attention is not supported"):
        ModelConfig.from_hf_config({**HF, "use_sliding_window": True, "sliding_window": 4096})


def test_null_flags_and_an_absent_rope_theta_take_their_defaults():
    """null is the default (tie_word_embeddings null: untied); no rope_theta anywhere is HF's 10,000."""
    cfg = ModelConfig.from_hf_config({**HF, "tie_word_embeddings": None, "use_sliding_window": None})
    assert cfg.tie_word_embeddings is False and cfg.rope_theta == 10000.0


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_a_rope_scaling_named_by_its_old_type_key_is_refused(key):
    """transformers 4's {"type": "linear"} is a scaling as much as {"rope_type": "linear"}."""
    with pytest.raises(ValueError, match="RoPE scaling is not supported"):
        ModelConfig.from_hf_config({**HF, key: {"type": "linear", "factor": 2.0}})


def test_an_unknown_preset_is_named_with_the_presets():
    with pytest.raises(ValueError, match=r"unknown model preset 'qwen9'; presets: .*tiny"):
        get_preset("qwen9")


@pytest.mark.parametrize("name", ["host_ratio", "storage_ratio"])
def test_an_infinite_tier_ratio_is_refused(name):
    from hicache.config import HiCacheConfig

    with pytest.raises(ValueError, match=f"hicache.{name} .* must be a finite number >= 0, got inf"):
        HiCacheConfig(**{name: float("inf")})

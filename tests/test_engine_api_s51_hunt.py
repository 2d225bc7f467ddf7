"""Regressions from session 51's hunt of the in-process API: an Engine that fails to start gives back its L3 file;
EngineConfig refuses, naming the field, what the flags' parser never makes (floats in integer fields, unknown dtype or
device names) and parses vLLM's dict form of speculative_config."""
from __future__ import annotations

import asyncio

import pytest

from scheduler import engine as engine_module
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.speculative import SpeculativeConfig


def test_an_engine_that_fails_to_start_gives_back_its_l3_file(tmp_path, monkeypatch):
    """Engine.__init__ opened and locked the L3 file with its cache, and a failure after that left it locked until
    the half-built engine was collected (never, while the exception is kept, as IPython keeps sys.last_value): the
    corrected retry on the same path was refused, "another store has it open"."""
    config = EngineConfig(model="tiny", device="cpu").with_hicache(enable=True, storage_path=str(tmp_path / "l3.kv"))

    class Broken:
        def __init__(self, engine):
            raise RuntimeError("admission failed to build")
    with monkeypatch.context() as m:
        m.setattr(engine_module, "Admission", Broken)
        with pytest.raises(RuntimeError, match="admission failed") as kept:  # (the exception, and its frames, kept)
            Engine(config)
    eng = Engine(config)
    assert kept.value is not None
    [out] = eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3))
    assert len(out.output_ids) == 3
    eng.check_integrity()
    asyncio.run(eng.shutdown())


@pytest.mark.parametrize("field, value", [("max_prefill_tokens", 1.5), ("page_size", 4.0), ("num_pages", 64.0),
                                          ("seed", 1.5), ("max_running_requests", True), ("cpu_threads", "1")])
def test_a_float_or_other_non_integer_in_an_integer_field_is_refused_naming_it(field, value):
    """Range checks alone let 1.5 through: max_prefill_tokens=1.5 built an engine whose loop crashed at its first
    request, page_size=4.0 failed in torch.zeros, seed=1.5 in manual_seed, none naming the field."""
    with pytest.raises(ValueError, match=f"{field}.*must be an integer"):
        EngineConfig(model="tiny", **{field: value})


def test_numpy_s_integers_are_taken_as_python_s():
    import numpy as np
    config = EngineConfig(model="tiny", page_size=np.int64(4), num_pages=np.int32(64))
    assert type(config.page_size) is int and config.page_size == 4 and type(config.num_pages) is int


@pytest.mark.parametrize("field, value", [("dtype", "fp16"), ("dtype", "half"), ("dtype", "float64"),
                                          ("device", "gpu"), ("device", "cuda:x")])
def test_an_unknown_dtype_or_device_is_refused_naming_it(field, value):
    """dtype "fp16" ran in float32 (bf16 on CUDA) without a word, as any name outside the table did; device "gpu"
    was torch's error naming no field."""
    with pytest.raises(ValueError, match=f"{field} must be"):
        EngineConfig(model="tiny", **{field: value})


def test_speculative_config_as_vllm_s_dict_is_parsed_as_the_flag_is():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    config = EngineConfig(model="tiny", device="cpu", speculative=spec)
    assert config.speculative == SpeculativeConfig.parse(spec)
    with pytest.raises(ValueError, match="speculative-config"):
        EngineConfig(model="tiny", speculative=["ngram"])
    eng = Engine(config)
    [spec_out] = eng.generate([[1, 2, 3, 1, 2, 3, 1, 2]], SamplingParams(max_tokens=6))
    [plain] = Engine(EngineConfig(model="tiny", device="cpu")).generate([[1, 2, 3, 1, 2, 3, 1, 2]],
                                                                        SamplingParams(max_tokens=6))
    assert spec_out.output_ids == plain.output_ids

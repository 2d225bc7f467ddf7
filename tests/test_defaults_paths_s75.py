"""Session 75 (defaults hunt): one setting, the same engine whichever path gives it (the dataclasses, the serve
flags)."""
from __future__ import annotations

import pytest

from scheduler.config import EngineConfig
from scheduler.serve import build_parser
from scheduler.config import config_from_args
from scheduler.speculative import SpeculativeConfig


def _from_flag(text: str) -> SpeculativeConfig:
    return config_from_args(build_parser().parse_args(["--speculative-config", text])).speculative


@pytest.mark.parametrize("given", [{"prompt_lookup_max": 8}, {"prompt_lookup_max": 2}, {"prompt_lookup_min": 7},
                                   {"prompt_lookup_min": 2}, {}])
def test_speculative_lookup_bounds_as_the_flag_fills_them(given):
    """vLLM fills a lookup bound left out from the other (both 5 when neither is given): the flag did, the
    dataclass kept 5 for it (regression: SpeculativeConfig(3, prompt_lookup_max=8) looked up 5..8-grams where
    --speculative-config's same keys looked up 8-grams only; prompt_lookup_max=2 alone was refused)."""
    flag = _from_flag('{"method": "ngram", "num_speculative_tokens": 3%s}'
                      % "".join(f', "{k}": {v}' for k, v in given.items()))
    direct = SpeculativeConfig(num_speculative_tokens=3, **given)
    assert direct == flag
    assert EngineConfig(speculative=direct).speculative == flag
    bound = next(iter(given.values()), 5)
    assert (direct.prompt_lookup_min, direct.prompt_lookup_max) == (bound, bound)


def test_speculative_lookup_bounds_given_both_are_kept():
    assert SpeculativeConfig(3, prompt_lookup_max=4, prompt_lookup_min=2) == _from_flag(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(3, prompt_lookup_max=2, prompt_lookup_min=4)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_n_takes_cudas_default_page(device):
    """device "cuda:N" is CUDA as "cuda" is (the engine's page of 16 tokens, its L1 sized from the GPU's memory):
    the config's checks took it for the CPU (regression: max_total_tokens=8 on "cuda:0" was not refused, and the
    engine built one page of 16 tokens where "cuda" refused it; l1_from_gpu_memory said False)."""
    with pytest.raises(ValueError, match="default page size 16"):
        EngineConfig(device=device, max_total_tokens=8)
    assert EngineConfig(device=device, max_total_tokens=0).l1_from_gpu_memory()

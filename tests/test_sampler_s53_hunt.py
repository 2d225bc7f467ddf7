"""Regressions from session 53's hunt of the sampler against vLLM V1: a temperature above 0 and below 0.01 samples
at 0.01, as vLLM's SamplingParams raises it (0.001 sampled as greedy), and min_tokens holds the EOS ids with
ignore_eos too, as vLLM's min-tokens processor holds every stop id (EOS came among the first min_tokens)."""
from __future__ import annotations

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import MIN_TEMPERATURE, SamplingParams

EOS = 7


@pytest.mark.parametrize("given,used", [(0.0, 0.0), (1e-6, 0.01), (0.001, 0.01), (0.01, 0.01), (0.5, 0.5)])
def test_a_tiny_temperature_samples_at_vllms_least(given, used):
    params = SamplingParams(max_tokens=2, temperature=given)
    params.validate(16)
    assert params.temperature == used and MIN_TEMPERATURE == 0.01


def test_a_tiny_temperature_samples_as_001_does():
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    prompt = [218, 14, 2, 100, 195]
    tiny = [r.output_ids for r in eng.generate([prompt] * 8, [SamplingParams(max_tokens=3, temperature=0.001,
                                                                               seed=s) for s in range(8)])]
    hundredth = [r.output_ids for r in eng.generate([prompt] * 8, [SamplingParams(max_tokens=3, temperature=0.01,
                                                                                    seed=s) for s in range(8)])]
    assert tiny == hundredth


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_holds_eos_with_ignore_eos_too(ignore_eos):
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    eng.add_eos_token_id(EOS)  # (a served model's EOS)
    params = SamplingParams(max_tokens=6, min_tokens=4, ignore_eos=ignore_eos, logit_bias={EOS: 100.0})
    out = eng.generate([[1, 2, 3, 4, 5]], params)[0]
    assert EOS not in out.output_ids[:4] and out.output_ids[4] == EOS
    assert out.finish_reason == ("length" if ignore_eos else "stop")

"""The Python API's results for a batch with a prompt the engine refuses (`Engine.generate_async`): the refused
prompt's `GenerationResult.cached_tokens` was `{}` where every other result's has its three tiers, so a caller
summing `r.cached_tokens["l1"]` over the results got a KeyError (scheduler/batch_api.py)."""
from __future__ import annotations

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams


@pytest.mark.asyncio
async def test_a_refused_prompts_result_has_every_tiers_cached_tokens():
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4))
    out = await eng.generate_async([[1, 2, 3], [], [4, 5, 6]], SamplingParams(max_tokens=2))
    assert [r.finish_reason for r in out] == ["length", "error", "length"], out
    assert all(set(r.cached_tokens) == {"l1", "l2", "l3"} for r in out), [r.cached_tokens for r in out]
    assert out[1].cached_tokens == {"l1": 0, "l2": 0, "l3": 0}
    await eng.shutdown()

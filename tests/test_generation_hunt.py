"""What a request's generation parameters mean, end to end (a bug hunt): sampling edge values,
malformed in-process parameters, stops and limits, through the Engine and the HTTP server. CPU, tiny
preset; each test is the regression test of a bug that was found and fixed."""
from __future__ import annotations

import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.sampling import sample

PROMPTS = [[5, 6, 7, 8, 9], [21, 22, 23, 24, 25, 26, 27]]


def _engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, **kw))


def assert_whole(engine: Engine) -> None:
    engine.check_integrity()
    alloc = engine.cache.l1.allocator
    assert alloc.num_private() == 0 and alloc.num_free + alloc.num_tree() == alloc.num_pages


# -- temperatures below float32's range ---------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-46, 1e-300, 5e-324])
def test_a_temperature_below_float32s_smallest_is_greedy_in_the_sampler(temperature):
    """The logits are float32: a temperature that float32 rounds to 0 (below ~1.4e-45, accepted as
    > 0) divided the largest logit, 0 after the shift, by 0, and NaN reached multinomial, which raised."""
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) * 5
    ids = sample(logits, [temperature] * 2, [1.0, 0.5], [torch.Generator().manual_seed(1), None])
    assert torch.equal(ids, torch.argmax(logits, dim=-1))


def test_a_temperature_below_float32s_smallest_does_not_fail_the_engine():
    """That raise was inside the loop: one request with temperature 1e-300 (a valid value, here and
    at the HTTP API) failed every request in flight and left the engine (and its server) dead."""
    eng = _engine()
    greedy = eng.generate(PROMPTS, SamplingParams(max_tokens=4))
    tiny = eng.generate(PROMPTS, [SamplingParams(max_tokens=4),
                                  SamplingParams(max_tokens=4, temperature=1e-300, seed=3)])
    assert [(r.finish_reason, r.output_ids) for r in tiny] == [(r.finish_reason, r.output_ids) for r in greedy]
    assert_whole(eng)


# -- malformed in-process parameters --------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(stop_token_ids=None), dict(stop_token_ids=7), dict(stop_token_ids=("7",)),
    dict(temperature=None), dict(temperature="0.5"), dict(top_p=None),
    dict(seed=1.5, temperature=1.0), dict(seed="3", temperature=1.0), dict(ignore_eos="no"),
], ids=lambda d: ",".join(f"{k}={v!r}" for k, v in d.items()))
def test_malformed_sampling_params_are_that_requests_error(bad):
    """SamplingParams checked max_tokens' type but not the others': stop_token_ids=None (as OpenAI's
    `stop: null`) or a bare id passed validation and raised in the loop at the first token (`in`),
    failing every request; None / string temperatures, top_p and seeds raised TypeError or
    RuntimeError out of add_request, so generate() raised and left the batch's other requests running
    with nobody waiting for them; ignore_eos="no" was truthy."""
    eng = _engine()
    [ref] = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=3))
    good, broken = eng.generate(PROMPTS, [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, **bad)])
    assert good.error is None and good.output_ids == ref.output_ids
    assert broken.finish_reason == "error" and next(iter(bad)) in broken.error, broken.error
    assert eng.stats["failed"] == 0
    assert_whole(eng)

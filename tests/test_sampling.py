"""Sampling (scheduler/sampling.py): every accepted temperature and top_p gives a valid draw."""
from __future__ import annotations

import pytest
import torch

from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.sampling import sample
from test_faults import PROMPT, REUSABLE, finish, make_engine


def _logits(rows: int = 3, vocab: int = 64) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 5


@pytest.mark.parametrize("temperature,top_p", [(1e-40, 1.0), (1e-30, 0.9), (1.0, 1e-300), (100.0, 1e-45)])
def test_extreme_values_pick_a_valid_token(temperature, top_p):
    logits = _logits()
    ids = sample(logits, [temperature] * 3, [top_p] * 3, [torch.Generator().manual_seed(i) for i in range(3)])
    assert ids.shape == (3,) and ((0 <= ids) & (ids < 64)).all()
    if temperature < 1e-20 or top_p < 1e-20:  # all mass on the likeliest token
        assert torch.equal(ids, torch.argmax(logits, dim=-1))


def test_non_finite_logits_still_sample():
    logits = _logits()
    logits[0, 5] = float("inf")
    logits[1, :] = float("nan")
    logits[2, 7] = float("nan")
    ids = sample(logits, [1.0, 1.0, 0.5], [1.0, 0.5, 1.0], [None, None, None])
    assert ids[0] == 5 and ((0 <= ids) & (ids < 64)).all()


def test_seeded_draws_repeat_and_greedy_rows_stay_argmax():
    logits = _logits()
    draw = lambda: sample(logits, [0.0, 0.8, 1.5], [1.0, 0.9, 1.0],
                          [None, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)])
    a, b = draw(), draw()
    assert torch.equal(a, b) and a[0] == torch.argmax(logits[0])


def test_temperature_draws_follow_the_softmax_and_top_p_cuts_the_tail():
    """Review regression (session 23): the sampling tests only compared draws with themselves, so
    sampling every row greedily passed them. Logits [0, log 3] draw token 1 three times in four at
    temperature 1, about half the time at temperature 100 (flat) and never at a tiny one, top_p 0.5
    keeps only token 1, and different seeds give different streams."""
    import math
    logits = torch.tensor([[0.0, math.log(3.0)]])  # [1, 2]: p = (0.25, 0.75)

    def draws(temperature, top_p, seed, n=2000):
        gen = torch.Generator().manual_seed(seed)
        return [int(sample(logits, [temperature], [top_p], [gen])[0]) for _ in range(n)]
    ones = sum(draws(1.0, 1.0, seed=1))
    assert 0.70 * 2000 < ones < 0.80 * 2000  # binomial sd ~19: a band of ~5 sd
    assert 0.40 * 2000 < sum(draws(100.0, 1.0, seed=2)) < 0.60 * 2000
    assert sum(draws(1e-4, 1.0, seed=3, n=200)) == 200
    assert sum(draws(1.0, 0.5, seed=4, n=200)) == 200  # 0.75 alone covers top_p 0.5
    assert draws(1.0, 1.0, seed=5, n=64) != draws(1.0, 1.0, seed=6, n=64)


def test_an_extreme_request_does_not_fail_the_others():
    """A temperature of 1e-40 used to make softmax NaN and multinomial raise inside the loop, which
    failed every request in flight."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    greedy = eng.generate(prompts, SamplingParams(max_tokens=4))
    tiny = eng.generate(prompts, SamplingParams(max_tokens=4, temperature=1e-40, top_p=1e-300, seed=3))
    assert [(r.finish_reason, r.output_ids) for r in tiny] == [(r.finish_reason, r.output_ids) for r in greedy]
    eng.check_integrity()


def test_a_seed_beyond_64_bits_is_a_request_error():
    from scheduler.request import RequestError

    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64))
    with pytest.raises(RequestError, match="64-bit"):
        SamplingParams(max_tokens=2, temperature=1.0, seed=1 << 64).validate(16)
    out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=1.0, seed=(1 << 64) - 1))
    assert len(out[0].output_ids) == 2


def test_a_seeded_stream_does_not_depend_on_chunks_or_cache_hits():
    """Every prefill chunk's row drew a token from the request's generator (thrown away but for the
    last chunk's), so a cold request chunked in 5 drew 4 more times than its cache hit."""
    import random

    rng = random.Random(0)
    prompt = [rng.randrange(512) for _ in range(33)]
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)

    def engine(**kw):
        return Engine(EngineConfig(model="tiny", device="cpu", num_pages=256, page_size=4, **kw))
    chunked = engine(max_prefill_tokens=8)
    cold = chunked.generate([prompt], p)[0]
    hit = chunked.generate([prompt], p)[0]
    whole = engine(enable_prefix_cache=False).generate([prompt], p)[0]
    assert hit.cached_tokens["l1"] == 32
    assert cold.output_ids == hit.output_ids == whole.output_ids


@pytest.mark.asyncio
@pytest.mark.parametrize("gave_up", [False, True], ids=["kept", "discarded"])
async def test_a_seeded_request_samples_the_same_through_an_overlapped_restore(gave_up):
    """A discarded overlapped forward (its layer wait gave up; or its restore failed or lost the
    publish race) had drawn from the request's generator: the rerun sampled a shifted stream."""
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=99, ignore_eos=True)
    eng = make_engine()
    await eng.start()
    [cold] = await eng.generate_async([PROMPT], params)
    await eng.cache.drain()
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    if gave_up:
        flags = iter([True])
        eng.runner.restore_wait_timed_out = lambda: next(flags, False)
    [restored] = await eng.generate_async([PROMPT], params)
    assert eng.stats["restore_overlaps"] == 1 and restored.cached_tokens["l2"] == REUSABLE
    assert eng.stats["restore_waits_timed_out"] == int(gave_up)
    assert restored.output_ids == cold.output_ids
    await finish(eng)

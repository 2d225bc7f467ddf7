"""The engine's decode token count (hicache_engine_tokens{kind="decode"}) is the tokens decode steps yielded:
with the overlap schedule a step is queued before the one before it ends, and the rows of requests that step
ended (on a stop token id) are thrown away, not counted (the speculative hunt, session 53)."""
import random

import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.speculative import SpeculativeConfig


def engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=512, **kw))


def poison_the_next_decode_step(eng: Engine) -> None:
    """The next decode step's requests have their K/V turned NaN just before it is planned (their logits NaN)."""
    orig = eng.admission.decode_batch

    def poisoned():
        for r in eng.running:
            eng.cache.l1.kv[:, :, torch.tensor(r.pages, dtype=torch.int64)] = float("nan")
        eng.admission.decode_batch = orig
        return orig()
    eng.admission.decode_batch = poisoned


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_tokens_are_the_tokens_yielded_after_each_first(overlap):
    rng = random.Random(7)
    prompts = [[rng.randrange(512) for _ in range(24)] for _ in range(7)]
    base = engine().generate(prompts, SamplingParams(max_tokens=30))
    stops = tuple(r.output_ids[9] for r in base)  # (each request ends on one of them, at different steps)
    eng = engine(overlap_schedule=overlap)
    results = eng.generate(prompts, SamplingParams(max_tokens=30, stop_token_ids=stops))
    assert {r.finish_reason for r in results} == {"stop"}
    assert len({len(r.output_ids) for r in results}) > 1  # (they end at different steps)
    yielded = sum(len(r.output_ids) - 1 for r in results)  # (each one's first token is its prefill's)
    assert eng.stats["decode_tokens"] == yielded


SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1, draft_policy="always")


def spec_engine(spec):
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=128, speculative=spec))


def test_a_banned_token_of_a_verify_step_is_not_counted_as_decoded():
    """Regression (session 58's hunt): a verify step's token that the request's bans refuse (its row had none left)
    fails the request without being kept, and was counted (a plain step's `fail_broken_bans` ends it first)."""
    params = SamplingParams(max_tokens=8, allowed_token_ids=(5,), bad_words_token_ids=((5, 5),))
    prompt = [5, 7, 5, 7, 5, 7, 5]
    got = {}
    for name, spec in (("plain", None), ("spec", SPEC)):
        eng = spec_engine(spec)
        [r] = eng.generate([prompt], params)
        got[name] = (r.output_ids, r.finish_reason, eng.stats["decode_tokens"],
                     eng.speculator.stats["verify_steps"] if spec else None)
    assert got["spec"][3] > 0, got  # (the premise: the failing step was a verify step)
    assert got["spec"][:2] == got["plain"][:2]  # the same answer and end
    assert got["spec"][2] == got["plain"][2], got  # decode tokens: the tokens kept


@pytest.mark.asyncio
@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "spec"])
async def test_a_nan_row_of_a_verify_step_is_not_counted_as_decoded(spec):
    """Its K/V turned NaN after its first token: the next step's token is a NaN mark, the request fails, and no
    token of that step was kept (a plain step leaves the NaN mark out of decode_tokens: so must a verify step)."""
    eng = spec_engine(spec)
    prompt = [5, 7, 5, 7, 5, 7, 5, 7]
    [first] = await eng.generate_async([prompt], SamplingParams(max_tokens=12, ignore_eos=True))  # (its answer:
    made = eng.stats["decode_tokens"]  # the next one's drafts, from the prefix cache)
    verified = eng.speculator.stats["verify_steps"] if spec else 0
    poison_the_next_decode_step(eng)
    [r] = await eng.generate_async([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert r.finish_reason == "error" and "NaN" in r.error and r.output_ids == first.output_ids[:1], r
    if spec is not None:
        assert eng.speculator.stats["verify_steps"] == verified + 1  # (the premise: the NaN step was a verify step)
    assert eng.stats["decode_tokens"] == made  # (nothing kept after the first token, which its prefill made)
    await eng.shutdown()

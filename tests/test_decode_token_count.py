"""The engine's decode token count (hicache_engine_tokens{kind="decode"}) is the tokens decode steps yielded:
with the overlap schedule a step is queued before the one before it ends, and the rows of requests that step
ended (on a stop token id) are thrown away, not counted (the speculative hunt, session 53)."""
import random

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams


def engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=512, **kw))


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

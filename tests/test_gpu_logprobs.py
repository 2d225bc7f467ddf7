"""Token logprobs on the GPU (skipped without CUDA): decode batches replayed from CUDA graphs and chained
on the device, their logprobs copied to pinned memory with the step's ids (scheduler/runner.py), equal a
dense forward's log_softmax, and a batch's rows that did not ask are sampled as if nobody had. The CPU
checks of the same: tests/test_logprobs.py."""
import asyncio
import math

import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 5, [40, 41, 42], [100, 7, 300, 12, 13] * 9, [9, 8, 7, 6, 5, 4, 3, 2, 1]]


async def _events(eng: Engine, params) -> list[list]:
    async def one(prompt, p):
        return [ev async for ev in eng.submit(prompt, p) if not ev.finished]
    await eng.start()
    out = await asyncio.gather(*(one(pr, p) for pr, p in zip(PROMPTS, params)))
    await eng.stop_loop()
    return out


@pytest.mark.parametrize("graphs", [True, False])
def test_logprobs_on_cuda_equal_a_dense_forwards_log_softmax(graphs):
    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16,
                              cuda_graphs=graphs))
    assert (eng.runner.graphs is not None) == graphs
    asking = [SamplingParams(max_tokens=12, logprobs=k) for k in (5, None, 20, 0)]
    nobody = [SamplingParams(max_tokens=12) for _ in PROMPTS]
    for _ in range(2):  # the second time over cached prefixes: tails and decode graphs
        events = asyncio.run(_events(eng, asking))
        plain = asyncio.run(_events(eng, nobody))
        for prompt, evs, plain_evs, p in zip(PROMPTS, events, plain, asking):
            output = [ev.token_id for ev in evs]
            assert output == [ev.token_id for ev in plain_evs]  # asking changes no token
            assert all(ev.logprobs is None for ev in plain_evs)
            if p.logprobs is None:
                assert all(ev.logprobs is None for ev in evs)
                continue
            with torch.inference_mode():
                ref = torch.log_softmax(eng.model.forward_dense(
                    torch.tensor(prompt + output[:-1], device="cuda"))[len(prompt) - 1:].float(), dim=-1)
            for i, ev in enumerate(evs):
                lp = ev.logprobs
                assert math.isclose(lp.logprob, float(ref[i, ev.token_id]), abs_tol=1e-3)
                assert math.isclose(lp.logprob, float(ref[i].max()), abs_tol=1e-3)  # greedy: the likeliest
                assert len(lp.top) == p.logprobs
                for (tid, v), want in zip(lp.top, torch.topk(ref[i], p.logprobs).values.tolist()):
                    assert math.isclose(v, want, abs_tol=1e-3) and math.isclose(v, float(ref[i, tid]), abs_tol=1e-3)
    assert eng.stats["chained_steps"] > 0
    eng.check_integrity()

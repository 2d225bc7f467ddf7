"""Session 74's hunt for process-wide state two Engine objects in one process share (an A/B comparison, a notebook
that rebuilds its engine). Pinned here:
- scheduler/engine_lifecycle.py `TORCH_THREADS`: an engine on the CPU sets torch's intra-op threads (cpu_threads, 1
  by default), which are the process's. A refused engine put them back (session 73), but a shut-down one never did:
  a notebook's own CPU work ran on one core for good once it had built (and shut down) an engine. They are now put
  back once the last CPU engine that set them is shut down, and not while another still runs on them.
- Two tiny CPU engines with different page sizes, hicache on/off and seeds, used in turn, give each the tokens it
  gives alone (nothing of one leaks into the other's outputs)."""
from __future__ import annotations

import asyncio
import random

import torch

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams


def _config(page_size: int = 4, hicache: bool = False, seed: int = 0, cpu_threads: int = 1) -> EngineConfig:
    config = EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=page_size, seed=seed,
                          cpu_threads=cpu_threads)
    return config.with_hicache(enable=True, transfer_backend="torch", policy="always") if hicache else config


def test_torchs_threads_are_put_back_when_the_last_engine_that_set_them_shuts_down():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = Engine(_config(cpu_threads=1))
        second = Engine(_config(cpu_threads=1))
        assert torch.get_num_threads() == 1
        asyncio.run(first.shutdown())
        assert torch.get_num_threads() == 1, "one engine's shutdown took the threads of another still running"
        asyncio.run(second.shutdown())
        assert torch.get_num_threads() == 2, "the process's torch was left on the engines' one thread"
        third = Engine(_config(cpu_threads=1))  # (built, shut down and built again: the same)
        asyncio.run(third.shutdown())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_an_engine_with_cpu_threads_0_leaves_the_threads_to_the_one_that_set_them():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        setter, other = Engine(_config(cpu_threads=1)), Engine(_config(cpu_threads=0))
        asyncio.run(other.shutdown())
        assert torch.get_num_threads() == 1
        asyncio.run(setter.shutdown())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_two_engines_used_in_turn_give_each_what_it_gives_alone():
    rng = random.Random(3)
    prompts = [[rng.randrange(500) for _ in range(9)] for _ in range(3)]
    params = [SamplingParams(max_tokens=5), SamplingParams(max_tokens=5, temperature=1.0, seed=5)]
    configs = [_config(4, False, 0), _config(8, True, 1)]

    def outputs(engine: Engine, p: SamplingParams) -> list[list[int]]:
        return [r.output_ids for r in engine.generate(prompts, p)]

    alone = []
    for config in configs:
        engine = Engine(config)
        alone.append([outputs(engine, p) for p in params])
        asyncio.run(engine.shutdown())
    engines = [Engine(config) for config in configs]
    together = [[], []]
    for p in params:
        for i, engine in enumerate(engines):
            together[i].append(outputs(engine, p))
    for engine in engines:
        asyncio.run(engine.shutdown())
    assert together == alone

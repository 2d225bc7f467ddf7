"""Session 74's hunt for process-wide state two Engine objects in one process share (an A/B comparison, a notebook
that rebuilds its engine). Pinned here: two tiny CPU engines with different page sizes, hicache on/off and seeds,
used in turn, give each the tokens it gives alone (nothing of one leaks into the other's outputs). Found and left
(docs/reliability.md): torch's CPU threads are the process's, and a shut-down CPU engine leaves them at its
`cpu_threads`; two engines with `log_json` share structlog's process-wide configuration.
"""
from __future__ import annotations

import asyncio
import random

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams


def _config(page_size: int = 4, hicache: bool = False, seed: int = 0, cpu_threads: int = 1) -> EngineConfig:
    config = EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=page_size, seed=seed,
                          cpu_threads=cpu_threads)
    return config.with_hicache(enable=True, transfer_backend="torch", policy="always") if hicache else config


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

"""Session 78's hunt: the public Python API's docstrings as a contract (tiny preset, CPU).

- scheduler/replay.py `replay_async`: a library caller's `concurrency` below 1, which the CLI refuses (--concurrency
  must be >= 1), hung the replay for good: its driver waited on a semaphore of no permit (0), or the run failed deep
  in asyncio (a negative one) after the engine was built; a non-integer was taken too. Refused up front, naming it."""
from __future__ import annotations

import asyncio

import pytest

HANG_GUARD_S = 20.0  # (a replay of one tiny request ends in well under a second; without the check it never does)


@pytest.mark.parametrize("concurrency", [0, -1, 1.5, True])
@pytest.mark.asyncio
async def test_replay_async_refuses_a_concurrency_below_one_rather_than_hang(concurrency):
    from scheduler.config import EngineConfig
    from scheduler.replay import ReplayItem, replay_async

    items = [ReplayItem(0, 1, 0.0, [1] * 8, 2)]
    config = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64)
    with pytest.raises(ValueError, match="concurrency"):
        await asyncio.wait_for(replay_async(config, items, concurrency=concurrency), HANG_GUARD_S)


@pytest.mark.asyncio
async def test_replay_async_still_runs_at_the_least_concurrency():
    from scheduler.config import EngineConfig
    from scheduler.replay import ReplayItem, replay_async

    items = [ReplayItem(0, 1, 0.0, [1] * 8, 2), ReplayItem(1, 2, 0.0, [1] * 8, 2)]
    config = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64)
    run = await asyncio.wait_for(replay_async(config, items, concurrency=1), HANG_GUARD_S)
    assert [len(o.output_ids) for o in run["outcomes"]] == [2, 2] and run["integrity"] == "passed"

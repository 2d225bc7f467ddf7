"""Overlap scheduling: decode step N+1 is enqueued with its input ids taken from step N's sampled
ids before step N's tokens reach the host. It must change nothing a client can see: same tokens,
same stop behaviour, same page accounting, whatever ends a request in the middle of a chain."""
import asyncio
import contextlib
import random

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams


def prompts(seed=0, n=6):
    rng = random.Random(seed)
    base = [rng.randrange(512) for _ in range(21)]
    return [base + [rng.randrange(512) for _ in range(rng.randrange(1, 9))] for _ in range(n)]


def assert_whole(engine):
    engine.check_integrity()
    for alloc in engine.cache.tree.allocators.values():
        assert alloc.num_private() == 0
        assert alloc.num_free + alloc.num_tree() == alloc.num_pages


async def run_all(cfg, ps, params):
    eng = Engine(cfg)
    await eng.start()
    outs = await asyncio.gather(*(eng.generate_async([p], sp) for p, sp in zip(ps, params)))
    await eng.stop_loop()
    return [o[0] for o in outs], eng


def mixed_params(stop_token: int | None):
    return [SamplingParams(max_tokens=1), SamplingParams(max_tokens=2), SamplingParams(max_tokens=12),
            SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=7),
            SamplingParams(max_tokens=12, stop_token_ids=(stop_token,) if stop_token is not None else ()),
            SamplingParams(max_tokens=5)]


@pytest.mark.asyncio
@pytest.mark.parametrize("tier", ["none", "l2"])
async def test_overlap_gives_the_same_tokens(tier):
    ps = prompts()
    base = EngineConfig(model="tiny", num_pages=96, page_size=4)
    if tier == "l2":
        base = base.with_hicache(enable=True, policy="always", host_ratio=2.0)
    plain = EngineConfig(**{**base.__dict__, "overlap_schedule": False})
    ref, _ = await run_all(plain, ps, mixed_params(None))
    stop = ref[4].output_ids[5]  # stop request 4 in the middle of its run
    ref, _ = await run_all(plain, ps, mixed_params(stop))
    got, eng = await run_all(base, ps, mixed_params(stop))
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in ref]
    assert ref[4].finish_reason == "stop" and len(ref[4].output_ids) <= 6
    assert eng.stats["chained_steps"] > 0
    assert_whole(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("abort_after", [1, 2, 4])
async def test_abort_during_a_chain_leaks_nothing(abort_after):
    eng = Engine(EngineConfig(model="tiny", num_pages=96, page_size=4))
    await eng.start()
    ps = prompts(seed=1, n=4)

    async def consume(i, p):
        got = []
        async with contextlib.aclosing(eng.submit(p, SamplingParams(max_tokens=10))) as stream:
            async for ev in stream:
                if i == 0 and len(got) >= abort_after:
                    break
                if ev.token_id is not None:
                    got.append(ev.token_id)
        return got

    got = await asyncio.gather(*(consume(i, p) for i, p in enumerate(ps)))
    await eng.stop_loop()
    assert len(got[0]) == abort_after and all(len(g) == 10 for g in got[1:])
    assert eng.stats["aborted"] == 1
    assert_whole(eng)


def test_flag_turns_overlap_off():
    import argparse

    from scheduler.config import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).overlap_schedule is True
    assert config_from_args(parser.parse_args(["--disable-overlap-schedule"])).overlap_schedule is False
    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4, overlap_schedule=False))
    eng.generate(prompts(n=2), SamplingParams(max_tokens=6))
    assert eng.stats["chained_steps"] == 0


@pytest.mark.asyncio
async def test_finished_backups_do_not_end_a_decode_chain():
    """Regression (session 3 GPU stress runs): every finished write-through backup woke the loop
    and ended the decode chain in flight, so batch-32 decode beside backups lost its overlap on
    the steps where one finished (0.94 of hicache off). Backups now wake only an idle loop."""
    ps = prompts(n=6)
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * 6
    base = EngineConfig(model="tiny", num_pages=96, page_size=4)
    _, off = await run_all(base, ps, params)
    _, on = await run_all(base.with_hicache(enable=True, policy="always", host_ratio=2.0), ps, params)
    assert on.metrics()["backups_done"] > 0
    assert on.stats["chained_steps"] == off.stats["chained_steps"] > 0
    assert_whole(on)

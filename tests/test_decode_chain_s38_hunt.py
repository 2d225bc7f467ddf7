"""Chained decode (Engine._run_decode_chain) with what rides along a step: penalties kept on the device per
request, logit_bias, min_tokens' masks, logprobs of differing k, seeded sampling. Requests join (staggered
submits), leave (max_tokens, stop ids, closed streams) and wait for a running slot while others decode, so
a request's batch row changes between steps. Each request must get what it gets run alone (a
differential check: tokens, finish_reason, logprobs), and the tiers must be whole after. On CUDA, the
same workloads chained and unchained must agree bit for bit (graphs, pinned rings, in-flight ids)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random

import pytest

from hicache.config import HiCacheConfig
from hicache_helpers import assert_whole
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

VOCAB = 512


def random_params(rng: random.Random) -> SamplingParams:
    """Greedy or seeded sampling, with any mix of the extras a step carries."""
    max_tokens = rng.randrange(1, 14)
    kw: dict = dict(max_tokens=max_tokens, ignore_eos=True)
    if rng.random() < 0.5:
        kw.update(temperature=rng.choice([0.7, 1.0, 1.5]), seed=rng.randrange(1000))
        if rng.random() < 0.3:
            kw["top_p"] = 0.9
        if rng.random() < 0.3:
            kw["top_k"] = rng.choice([5, 20])
        if rng.random() < 0.2:
            kw["min_p"] = 0.05
    if rng.random() < 0.4:
        kw["presence_penalty"] = rng.choice([-1.0, 0.5, 2.0])
    if rng.random() < 0.4:
        kw["frequency_penalty"] = rng.choice([-0.5, 1.0, 2.0])
    if rng.random() < 0.4:
        kw["repetition_penalty"] = rng.choice([0.5, 1.3, 3.0])
    if rng.random() < 0.3:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.choice([-100.0, 5.0, 100.0]) for _ in range(rng.randrange(1, 4))}
    if rng.random() < 0.4:
        kw["logprobs"] = rng.choice([0, 1, 3, 20])
    if rng.random() < 0.3:
        kw["stop_token_ids"] = tuple(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30)))
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randrange(0, max_tokens + 1)
    return SamplingParams(**kw)


def random_workload(seed: int):
    """(prompt, params, submit delay in loop turns, tokens after which its stream closes or None)."""
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 30))]
    out = []
    for _ in range(rng.randrange(2, 9)):
        shared = base[:rng.randrange(0, len(base))] if rng.random() < 0.5 else []
        prompt = shared + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        delay = rng.choice([0, 0, rng.randrange(1, 200)])
        close_after = rng.randrange(1, 8) if rng.random() < 0.15 else None
        out.append((prompt, random_params(rng), delay, close_after))
    return out


async def run_staggered(eng: Engine, workload):
    """Each request's (token ids, logprobs, finishing event or None where its stream was closed)."""
    await eng.start()

    async def one(prompt, params, delay, close_after):
        for _ in range(delay):
            await asyncio.sleep(0)
        tokens, lps = [], []
        async with contextlib.aclosing(eng.submit(prompt, params)) as stream:
            async for ev in stream:
                if ev.finished:
                    return tokens, lps, ev
                tokens.append(ev.token_id)
                lps.append(ev.logprobs)
                if close_after is not None and len(tokens) >= close_after:
                    return tokens, lps, None
    out = await asyncio.gather(*(one(*w) for w in workload))
    await eng.stop_loop()
    return out


async def run_alone(workload):
    """Each request alone on an engine with no prefix cache and no chained decode."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256, enable_prefix_cache=False,
                              overlap_schedule=False))
    out = [(await eng.generate_async([prompt], params))[0] for prompt, params, _, _ in workload]
    await eng.shutdown()
    return out


def assert_as_alone(got, ref, workload) -> None:
    """Each request of `run_staggered` got what it got alone (`run_alone`): tokens, finish, logprobs."""
    for i, ((tokens, lps, fin), alone, (_, params, _, _)) in enumerate(zip(got, ref, workload)):
        if fin is None:  # its stream was closed: what it had is where the request alone went
            assert tokens == alone.output_ids[:len(tokens)], (i, params)
            continue
        assert (tokens, fin.finish_reason) == (alone.output_ids, alone.finish_reason), (i, params)
        if params.logprobs is not None:
            assert all(same_logprobs(a, b) for a, b in zip(lps, alone.logprobs)), (i, params)
        else:
            assert all(lp is None for lp in lps)


def same_logprobs(a, b) -> bool:
    return (a is not None and math.isclose(a.logprob, b.logprob, abs_tol=1e-4) and len(a.top) == len(b.top)
            and all(math.isclose(x, y, abs_tol=1e-4) for (_, x), (_, y) in zip(a.top, b.top)))


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("engine_kw", [{}, {"max_running_requests": 2}, {"max_prefill_tokens": 5},
                                       {"num_pages": 24, "hicache": HiCacheConfig(enable=True, policy="always",
                                                                                  host_ratio=3.0)}],
                         ids=["plain", "two-running", "chunked", "l2-restores"])
async def test_each_request_of_a_chained_workload_gets_what_it_gets_alone(seed, engine_kw):
    workload = random_workload(seed)
    if "hicache" in engine_kw:  # each prompt twice: the second may come back from L2 (a few behind their tail)
        workload = workload + workload
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, **{"num_pages": 256, **engine_kw}))
    assert_as_alone(await run_staggered(eng, workload), await run_alone(workload), workload)
    assert eng.stats["chained_steps"] > 0
    assert_whole(eng.cache)
    await eng.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
def test_chained_and_unchained_decode_agree_bit_for_bit_on_cuda(seed):
    """The same workload on CUDA graphs, chained and not: tokens, finish reasons and logprobs equal, bit for
    bit. All submitted at once and none with stop ids (a stopped request's discarded chained step would
    change that step's batch), so both run the same batches step by step."""
    workload = random_workload(seed)
    prompts = [w[0] for w in workload] * 3
    params = [dataclasses.replace(w[1], stop_token_ids=()) for w in workload] * 3
    results = {}
    for overlap in (True, False):
        eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16,
                                  overlap_schedule=overlap))
        results[overlap] = eng.generate(prompts, params)
        assert (eng.stats["chained_steps"] > 0) == overlap
        eng.check_integrity()
    for a, b, p in zip(results[True], results[False], params):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason), p
        assert a.logprobs == b.logprobs, p


@pytest.mark.parametrize("wait_for,write_policy", [("slot", None), ("memory", None), ("memory", "write_back")])
def test_a_request_waiting_for_a_slot_or_l1_room_does_not_unchain_decode(wait_for, write_policy):
    """Regressions: `chain_decode_batch` ended the chain whenever a request waited, though one waiting for a
    running slot (max_running_requests reached) is admitted only once another finishes (session 38), and one
    that no L1 room could take only once room comes back as another finishes (session 39; each tick tried it
    in vain): 6 requests run two at a time chained 8 steps, not 24. Three pairs of equal requests must chain
    as three times one pair does, with the same tokens (under write_back too, whose admission may wait for
    the backups of the leaves it evicts)."""
    def run(n: int) -> tuple[int, list]:
        # (12 pages: 5 a request, each reserving all its max_tokens: decode_reserve_ratio 1)
        limit = dict(max_running_requests=2, num_pages=256) if wait_for == "slot" else dict(num_pages=12)
        cfg = EngineConfig(model="tiny", device="cpu", page_size=4, decode_reserve_ratio=1.0, **limit)
        eng = Engine(cfg.with_hicache(enable=True, write_policy=write_policy, storage_ratio=0.0)  # (no L3:
                     if write_policy else cfg)  # tests/test_write_back_wake_s40.py has it)
        results = eng.generate([[i + 1] * 9 for i in range(n)], SamplingParams(max_tokens=10))
        eng.check_integrity()
        return eng.stats["chained_steps"], [r.output_ids for r in results]

    chained_pair, outputs_pair = run(2)
    chained_six, outputs_six = run(6)
    assert chained_pair > 0
    assert chained_six >= 3 * chained_pair
    assert outputs_six[:2] == outputs_pair


@pytest.mark.parametrize("wait_for", ["slot", "memory"])
def test_probe_chain_wait_times_the_kept_rule_against_the_old_one(wait_for, capsys):
    """scripts/probe_chain_wait.py on the CPU (a smoke run): its "old" rule, patched in, chains fewer steps
    than the kept one on the same workload, and the kept rule is back in place after."""
    import importlib.util
    from pathlib import Path

    from scheduler import admission
    path = Path(__file__).resolve().parents[1] / "scripts" / "probe_chain_wait.py"
    spec = importlib.util.spec_from_file_location("probe_chain_wait", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    kept = admission.Admission.chain_decode_batch
    assert probe.main(["--model", "tiny", "--device", "cpu", "--requests", "6", "--slots", "2", "--prompt-tokens",
                       "9", "--new-tokens", "10", "--rounds", "1", "--wait-for", wait_for]) == 0
    assert admission.Admission.chain_decode_batch is kept
    out = capsys.readouterr().out
    chained = {name: int(out.split(f"round 0 {name}: ")[1].split(" tokens/s, ")[1].split(" chained")[0])
               for name in ("new", "old")}
    assert chained["new"] > chained["old"] > 0, out

"""Differential fuzz of token logprobs (SamplingParams.logprobs) through the whole engine: the seeded
workloads of tests/test_diff_fuzz_hunt.py (shared prefixes cut across pages, next turns, greedy and
seeded sampled requests, aborts, stop ids, tiny tiers that evict to L2/L3 and restore, restores
overlapped with the tail's forward, prefetches taken on, chunked prefill, chained decode, restarts,
flushes, injected faults that make restores fail and requests recompute), where some requests ask
for logprobs with a random k (0..20) and the others do not, and, in some cases, a cached prefix is
poisoned with NaN between rounds (its requests fail; the others must not notice).

Per request: every token event of an asking request carries logprobs and none of a non-asking one;
its GenerationResult has one per output token (the events' own, in order); top-k has k entries, sorted,
all <= 0; each event's logprob is the log_softmax of a dense forward over prompt + output so far at
that event's token (and the top-k its k largest); its tokens equal a no-cache engine's that asked for
no logprobs (a finished request's exactly, an aborted one's a prefix). Every tier whole after each round.

`python tests/test_logprobs_diff_hunt.py FIRST LAST` runs seeds FIRST..LAST (three rounds each) and
prints each case and its failures.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from hicache_helpers import assert_whole, flip_l3_byte
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams, TokenLogprobs
from test_diff_fuzz_hunt import (MAX_TOKENS, RUN_TIMEOUT_S, Case, Spec, describe, flush, hang_state,
                                 make_case as base_case, make_injector)

ABS_TOL = 1e-4  # float32 paged forward vs the dense reference, on the CPU (as tests/test_logprobs.py)


@dataclass
class LpSpec(Spec):
    logprobs: int | None = None

    def params(self, max_tokens: int | None = None, asking: bool = True) -> SamplingParams:
        return dataclasses.replace(super().params(max_tokens), logprobs=self.logprobs if asking else None)


def make_case(seed: int) -> Case:
    """The diff fuzz's case, each request asking for logprobs (a random k) or not; sometimes a
    cached prefix is poisoned with NaN between rounds (`case.nan_round`)."""
    case = base_case(seed)
    rng = random.Random(seed * 7919 + 1)
    ask_rate = rng.choice([0.3, 0.5, 0.8, 1.0])
    ks = rng.choice([[0], [1, 2], [0, 1, 5, 20], [3, 20]])
    specs = []
    for s in case.requests:
        lp = LpSpec(**vars(s))
        if rng.random() < ask_rate:
            lp.logprobs = rng.choice(ks)
        if lp.abort is not None and lp.abort[0] == "after_s" and rng.random() < 0.5:
            lp.abort = ("stop_after_s", lp.abort[1])  # a caller's stop condition (an API stop string)
        specs.append(lp)
    case.requests = specs
    case.nan_round = rng.randrange(2) if (rng.random() < 0.15 and case.rounds_mode == "drained") else None
    # restores that fail or land late, so that the forward behind one is held and then kept or thrown
    # away: transfers that raise, L3 reads that fail, checksums that run late (a landed prefetch is taken
    # on to L1 under the tail's forward) and L3 bytes flipped between rounds (its checksum fails)
    if rng.random() < 0.35:
        case.faults = "restore"
        case.engine.update(restore_overlap=True, max_prefill_tokens=rng.choice([16, 2048]))
        case.hicache.update(prefetch=True, storage_checksum=True, io_timeout_s=30.0,
                            storage_ratio=case.hicache["storage_ratio"] or 2.0)
    case.flip_l3 = case.faults == "restore" and rng.random() < 0.5
    return case


def make_engine(case: Case) -> Engine:
    """As the diff fuzz's, with the "restore" fault mode's injector."""
    base = EngineConfig(model="tiny", device="cpu", page_size=case.page_size, num_pages=case.num_pages,
                        **case.engine)
    host_pages = int(case.num_pages * case.hicache["host_ratio"])
    hc = dict(case.hicache)
    if host_pages < 1:
        hc["host_ratio"], host_pages = 1.0, case.num_pages
    if hc["storage_ratio"] and int(host_pages * hc["storage_ratio"]) < 1:
        hc["storage_ratio"] = 1.0
    if case.faults == "restore":
        faults = FaultInjector()
        for n, (fault, probability) in enumerate([(Fault.TRANSFER_RAISE, 0.2), (Fault.EIO_READ, 0.1),
                                                  (Fault.SLOW_VERIFY, 0.5), (Fault.SLOW_READ, 0.2)]):
            faults.arm(fault, times=None, probability=probability, seed=case.seed * 31 + n,
                       delay_s=0.01 if fault in (Fault.SLOW_VERIFY, Fault.SLOW_READ) else 0.0)
    else:
        faults = make_injector(case)
    return Engine(base.with_hicache(enable=True, **hc), faults=faults)


def flip_some_l3(eng: Engine, rng: random.Random) -> None:
    """A byte flipped in a few L3 pages the tree holds (their reads then fail their checksums)."""
    if Tier.L3 not in eng.cache.tree.allocators:
        return
    slots = [p for node in eng.cache.tree.iter_nodes() if node.pages[Tier.L3] for p in node.pages[Tier.L3]]
    for slot in rng.sample(slots, min(len(slots), rng.randrange(1, 4))):
        flip_l3_byte(eng.cache, slot)


async def resolve_turns(case: Case) -> None:
    """Each next turn's prompt from its parent's prompt and the reference's output."""
    while any(isinstance(r.prompt, tuple) for r in case.requests):
        want = await reference([r for r in case.requests if isinstance(r.prompt, list)], case.page_size)
        for r in case.requests:
            parent = case.requests[r.prompt[1]] if isinstance(r.prompt, tuple) else None
            if parent is not None and isinstance(parent.prompt, list) and parent.key() in want:
                r.prompt = parent.prompt + want[parent.key()][:r.prompt[2]] + r.prompt[3]


async def reference(specs, page_size: int) -> dict[tuple, list[int]]:
    """MAX_TOKENS tokens per distinct (prompt, sampling) from an engine without any cache, one
    request at a time, asking for no logprobs (asking must not change a token)."""
    distinct = {s.key(): s for s in specs}
    keys = sorted(distinct)
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=4096, page_size=page_size,
                              enable_prefix_cache=False, max_running_requests=1))
    out = await eng.generate_async([list(k[0]) for k in keys],
                                   [distinct[k].params(MAX_TOKENS, asking=False) for k in keys])
    await eng.shutdown()
    return {k: r.output_ids for k, r in zip(keys, out)}


def poison(eng: Engine, case: Case, rng: random.Random) -> bool:
    """NaN into the L1 pages of a cached prefix of one of the prompts (between drained rounds)."""
    prompts = [r.prompt for r in case.requests]
    rng.shuffle(prompts)
    for prompt in prompts:
        m = eng.cache.tree.match(prompt, include_storage=False, touch=False)
        if m.pages[Tier.L1]:
            pages = list(m.pages[Tier.L1])[-rng.randrange(1, len(m.pages[Tier.L1]) + 1):]
            eng.cache.l1.kv[:, :, torch.tensor(pages, dtype=torch.int64)] = float("nan")
            return True
    return False


async def run_case(case: Case, rounds: int = 2) -> list[str]:
    """Runs the workload `rounds` times through one engine; returns what went wrong (empty: nothing)."""
    await resolve_turns(case)
    eng = make_engine(case)
    problems: list[str] = []
    results = []  # (index, spec, [(token, logprobs)], reason, request or None)

    async def one(i: int, spec: LpSpec):
        if spec.abort is not None and spec.abort[0] == "close":  # the client goes away after n tokens
            events, reason = [], "abort"
            stream = eng.submit(spec.prompt, spec.params())
            async for ev in stream:
                if ev.finished:
                    reason = ev.finish_reason
                    break
                events.append((ev.token_id, ev.logprobs))
                if len(events) >= spec.abort[1]:
                    break
            await stream.aclose()
            results.append((i, spec, events, reason, None))
            return
        await eng.start()
        try:
            req = eng.add_request(spec.prompt, spec.params())
        except RequestError as exc:  # (only while stop_loop or shutdown runs)
            results.append((i, spec, [], "refused: " + str(exc), None))
            return
        if spec.abort is not None:
            stop = spec.abort[0] == "stop_after_s"
            asyncio.get_running_loop().call_later(
                spec.abort[1], lambda: asyncio.ensure_future(eng.abort(req.rid, stop=stop)))
        events, reason = [], None
        while reason is None:
            ev = await req.queue.get()
            if ev.finished:
                reason = ev.finish_reason
                if ev.logprobs is not None:
                    problems.append(f"request {i}: its end event carries logprobs")
            else:
                events.append((ev.token_id, ev.logprobs))
        results.append((i, spec, events, reason, req))

    async def submit_round(r: int, order: list[int]) -> list:
        tasks = []
        for i in order:
            spec = case.requests[i]
            if spec.delay_s:
                await asyncio.sleep(spec.delay_s)
            tasks.append(asyncio.ensure_future(one(i + r * len(case.requests), spec)))
        return tasks

    async def check_whole(r: int) -> None:
        await asyncio.wait_for(eng.stop_loop(), RUN_TIMEOUT_S)
        await asyncio.wait_for(eng.cache.drain(), RUN_TIMEOUT_S)
        if eng.requests:
            problems.append(f"round {r}: requests left {list(eng.requests)}")
        try:
            assert_whole(eng.cache)
        except AssertionError as exc:
            problems.append(f"round {r}: not whole: {exc}")

    rng = random.Random(case.order_seed)
    shut = False
    phase = "start"
    poisoned_from = None  # results index from which a request may fail on the NaN prefix
    try:
        order = list(range(len(case.requests)))
        pending = []
        for r in range(rounds):
            if r:
                rng.shuffle(order)
            last = r == rounds - 1
            if case.rounds_mode == "overlapping" and not last:
                pending += await submit_round(r, list(order))
                await asyncio.sleep(rng.uniform(0, 0.03))
                continue
            tasks = pending + await submit_round(r, list(order))
            pending = []
            between, mid = case.flushes[r % len(case.flushes)]
            if mid is not None:
                await asyncio.sleep(rng.uniform(0, 0.01))
                phase = f"round {r}: flush {mid} mid-round"
                await asyncio.wait_for(flush(eng, mid), RUN_TIMEOUT_S)
            if case.rounds_mode == "restart" or (case.rounds_mode == "shutdown" and last):
                await asyncio.sleep(rng.uniform(0, 0.03))
                if case.rounds_mode == "restart":
                    for _ in range(rng.randrange(1, 4)):
                        phase = f"round {r}: restart's stop_loop"
                        await asyncio.wait_for(eng.stop_loop(), RUN_TIMEOUT_S)
                        await eng.start()
                        await asyncio.sleep(rng.uniform(0, 0.01))
                else:
                    shut = True
                    await asyncio.wait_for(eng.shutdown(grace_s=rng.choice([0.0, 0.01])), RUN_TIMEOUT_S)
            phase = f"round {r}: requests"
            await asyncio.wait_for(asyncio.gather(*tasks), RUN_TIMEOUT_S)
            phase = f"round {r}: check"
            if shut:
                if eng.requests:
                    problems.append(f"after shutdown: requests left {list(eng.requests)}")
            else:
                await check_whole(r)
                phase = f"round {r}: flush {between} between rounds"
                await asyncio.wait_for(flush(eng, between), RUN_TIMEOUT_S)
                if case.flip_l3:
                    flip_some_l3(eng, rng)
                if case.nan_round == r and poisoned_from is None and poison(eng, case, rng):
                    poisoned_from = (r + 1) * len(case.requests)
    except asyncio.TimeoutError:
        problems.append(f"hang in {phase}: {len(results)} requests ended; waiting {len(eng.waiting)} parked "
                        f"{len(eng.parked)} running {len(eng.running)}; " + hang_state(eng))
    finally:
        case.metrics, case.stats = eng.metrics(), dict(eng.stats)
        if not shut:
            await asyncio.wait_for(eng.shutdown(), RUN_TIMEOUT_S)
    want = await reference(case.requests, case.page_size)
    dense: dict[tuple, torch.Tensor] = {}
    for i, spec, events, reason, req in sorted(results, key=lambda r: r[0]):
        problems += check_request(eng, dense, i, spec, events, reason, req, want[spec.key()], shut,
                                  poisoned_from is not None and i >= poisoned_from)
    return problems


def check_request(eng: Engine, dense: dict, i: int, spec: LpSpec, events: list, reason: str, req, full: list[int],
                  shut: bool, may_fail: bool) -> list[str]:
    tokens = [t for t, _ in events]
    expected = full[:spec.max_tokens]
    stops = [n for n, t in enumerate(expected) if t in spec.stop_token_ids]
    if stops:
        expected = expected[:stops[0] + 1]
    why = f"request {i}: {reason} {tokens} != {expected}; prompt {len(spec.prompt)} tokens, {spec}"
    if req is not None:
        why += f", hits {req.hit_tokens}, restore {req.restore_tier}, restore_failed {req.restore_failed}"
    problems = []
    stopped = spec.abort is not None and spec.abort[0] == "stop_after_s" and reason == "stop"
    if reason == "abort" or stopped or (shut and reason.startswith("refused")) or (may_fail and reason == "error"):
        if tokens != expected[:len(tokens)]:
            problems.append(why)
    elif reason != ("stop" if stops else "length") or tokens != expected:
        problems.append(why)
    # each event: logprobs exactly when asked, of the right shape and value
    asking = spec.logprobs is not None
    for n, (token, lp) in enumerate(events):
        if not asking:
            if lp is not None:
                problems.append(f"request {i}: event {n} carries logprobs it did not ask for; {why}")
            continue
        if not isinstance(lp, TokenLogprobs):
            problems.append(f"request {i}: event {n} (token {token}) has no logprobs; {why}")
            continue
        values = [v for _, v in lp.top]
        if len(lp.top) != spec.logprobs or values != sorted(values, reverse=True) or any(v > 0 for v in values) \
                or not lp.logprob <= 0.0:
            problems.append(f"request {i}: event {n}: bad shape {lp} for k={spec.logprobs}")
            continue
        key = tuple(spec.prompt + tokens)
        if key not in dense:
            with torch.inference_mode():
                logits = eng.model.forward_dense(torch.tensor(spec.prompt + tokens[:-1]))[len(spec.prompt) - 1:]
            dense[key] = torch.log_softmax(logits.float(), dim=-1)
        ref = dense[key][n]
        ref_top = torch.topk(ref, spec.logprobs).values.tolist() if spec.logprobs else []
        if not math.isclose(lp.logprob, float(ref[token]), abs_tol=ABS_TOL) or any(
                not math.isclose(v, w, abs_tol=ABS_TOL) or not math.isclose(v, float(ref[t]), abs_tol=ABS_TOL)
                for (t, v), w in zip(lp.top, ref_top)):
            problems.append(f"request {i}: event {n} (token {token}): logprobs {lp.logprob} top {lp.top[:3]} != "
                            f"dense {float(ref[token])} top {ref_top[:3]}; {why}")
        if spec.temperature == 0.0 and not math.isclose(lp.logprob, float(ref.max()), abs_tol=ABS_TOL):
            problems.append(f"request {i}: event {n}: a greedy token below the top logprob; {why}")
    if req is not None:  # its result: one logprob per output token, the events' own
        result = req.result()
        if result.output_ids[:len(tokens)] != tokens:
            problems.append(f"request {i}: result {result.output_ids} vs events {tokens}")
        if not asking:
            if result.logprobs is not None:
                problems.append(f"request {i}: result logprobs {result.logprobs} not asked for")
        elif result.logprobs is None or len(result.logprobs) != len(result.output_ids) or any(
                a is not b for a, (_, b) in zip(result.logprobs, events)):
            problems.append(f"request {i}: result has {None if result.logprobs is None else len(result.logprobs)} "
                            f"logprobs for {len(result.output_ids)} tokens (events {len(events)}); {why}")
    return problems


def describe_lp(case: Case) -> str:
    asks = [r.logprobs for r in case.requests]
    return (describe(case) + f", logprobs {sum(k is not None for k in asks)}/{len(asks)} asking "
            f"k {sorted({k for k in asks if k is not None})}, nan_round {case.nan_round}, flip_l3 {case.flip_l3}")


# -- the fuzz ------------------------------------------------------------------------------------
FUZZ_SEEDS = [9, 16, 74, 76, 78, 247]  # seeded sampling, held and discarded overlapped forwards, take-ons, a NaN prefix


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", FUZZ_SEEDS)
async def test_random_workloads_logprobs_match_a_dense_forward(seed):
    case = make_case(seed)
    problems = await run_case(case)
    assert not problems, describe_lp(case) + "\n" + "\n".join(problems)


if __name__ == "__main__":
    import traceback

    import uvloop

    import conftest  # noqa: F401  (the test setup: interpreted Triton, one torch thread, quiet logs)
    import test_diff_fuzz_hunt

    first, last = int(sys.argv[1]), int(sys.argv[2])
    test_diff_fuzz_hunt.MAX_REQUESTS = int(os.environ.get("MAX_REQUESTS", test_diff_fuzz_hunt.MAX_REQUESTS))
    failed = 0
    for seed in range(first, last + 1):
        case = make_case(seed)
        if os.environ.get("ROUNDS_MODE"):
            case.rounds_mode = os.environ["ROUNDS_MODE"]
        t0 = time.perf_counter()
        try:
            problems = uvloop.run(run_case(case, rounds=3))
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                raise
            problems = ["exception: " + "".join(traceback.format_exception(exc))]
        failed += bool(problems)
        st = getattr(case, "stats", {})
        print(f"     overlaps {st.get('restore_overlaps')} chained {st.get('chained_steps')} failed {st.get('failed')} "
              f"restore failures {getattr(case, 'metrics', {}).get('failures')}", flush=True)
        print(f"{'FAIL' if problems else 'ok  '} {time.perf_counter() - t0:5.1f}s {describe_lp(case)}", flush=True)
        for p in problems:
            print("    " + p, flush=True)
    print(f"{failed} of {last - first + 1} seeds failed", flush=True)

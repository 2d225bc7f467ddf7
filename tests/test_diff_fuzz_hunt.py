"""Differential fuzz of the whole engine: seeded random workloads (a few shared prefixes cut at random
lengths that cross page boundaries, random tails and max_tokens, random arrival interleavings through
the async API, random aborts) through engines with random hicache configurations (tiers, write and
restore policies, prefetch, page sizes, tiny capacities forcing evictions). Every finished request's
greedy tokens must equal a no-cache engine's for the same prompt (an aborted request's partial output
a prefix of them), no request may hang, and every tier must be whole after each run.

`python tests/test_diff_fuzz_hunt.py FIRST LAST` runs seeds FIRST..LAST (three rounds each) and prints
each case and its failures; ROUNDS_MODE=restart (etc.) forces a rounds mode, MAX_REQUESTS=50 larger
workloads. A hang prints where the loop waits (`hang_state`).
"""
from __future__ import annotations

import asyncio
import io
import os
import random
import sys
import time
from dataclasses import dataclass, field

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from hicache_helpers import assert_whole, until
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, RequestState, SamplingParams

VOCAB = 512
MAX_TOKENS = 8
RUN_TIMEOUT_S = 30.0
MAX_REQUESTS = 20  # per round (the hunt raises it)


@dataclass
class Spec:
    """One request of a workload: its prompt (a list, or ("turn", parent index, k, tail): the parent's
    prompt, k tokens of its output, then the tail), sampling, arrival and abort."""
    prompt: object
    max_tokens: int
    delay_s: float = 0.0  # before it is submitted
    # ("after_s", s): aborted s seconds after it is queued; ("close", n): its stream closed after n tokens
    abort: tuple | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple = ()

    def params(self, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens or self.max_tokens, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop_token_ids=self.stop_token_ids)

    def key(self) -> tuple:
        return (tuple(self.prompt), self.temperature, self.top_p, self.seed, self.stop_token_ids)

    def reference_params(self) -> SamplingParams:
        """What the no-cache reference asks for it (MAX_TOKENS tokens; a subclass drops its extras)."""
        return self.params(MAX_TOKENS)


@dataclass
class Case:
    seed: int
    page_size: int
    num_pages: int
    engine: dict
    hicache: dict
    requests: list = field(default_factory=list)  # Spec per request, in submission order
    faults: str = "none"  # none | slow (L3 reads and checks delayed) | all (every fault, rarely)
    order_seed: int = 0  # shuffles the submission order of the later rounds
    # drained: each round ends (stop_loop, drain) before the next; overlapping: the next round starts
    # while this one runs; restart: stop_loop() mid-round, then start(); shutdown: the last round is
    # cut by shutdown(grace)
    rounds_mode: str = "drained"
    # per round: an operator's flush ("l1", "l2", "l3", "l1_async") between rounds and one mid-round, or None
    flushes: list = field(default_factory=list)


def make_case(seed: int) -> Case:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 4, 8, 16])
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randrange(2 * page_size, 40 + page_size))]
             for _ in range(rng.choice([1, 1, 2, 3, 4, 5]))]
    requests = []
    sampled = rng.random() < 0.3
    abort_rate = rng.choice([0.0, 0.15, 0.15, 0.5])
    for n in range(rng.randrange(4, MAX_REQUESTS)):
        tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 2 * page_size + 2))]
        if n and rng.random() < 0.25:  # a next turn: an earlier prompt, k of its output tokens, a tail
            prompt = ("turn", rng.randrange(n), rng.randrange(0, MAX_TOKENS + 1), tail + [rng.randrange(VOCAB)])
        else:
            base = rng.choice(bases)
            cut = rng.choice([rng.randrange(0, len(base) + 1), len(base) - len(base) % page_size])
            prompt = base[:cut] + (tail or [rng.randrange(VOCAB)] if not cut else tail)
        spec = Spec(prompt, rng.randrange(1, MAX_TOKENS + 1), delay_s=rng.choice([0.0, 0.0, 0.0, rng.uniform(0, 0.02)]))
        if rng.random() < abort_rate:
            spec.abort = rng.choice([("after_s", 0.0), ("after_s", rng.uniform(0, 0.02)),
                                     ("close", rng.randrange(0, 4))])
        if sampled and rng.random() < 0.5:
            spec.temperature, spec.top_p = rng.choice([0.7, 1.0]), rng.choice([1.0, 0.9])
            spec.seed = rng.randrange(1000)
        if rng.random() < 0.1:
            spec.stop_token_ids = tuple(rng.randrange(VOCAB) for _ in range(40))
        requests.append(spec)
    longest_pages = max(-(-(bound_tokens(requests, i) + r.max_tokens - 1) // page_size) for i, r in enumerate(requests))
    num_pages = longest_pages + rng.choice([0, 1, 3, longest_pages // 2, longest_pages, 4 * longest_pages])
    engine = {"max_running_requests": rng.choice([1, 2, 4, 8]),
              "max_prefill_tokens": rng.choice([1, page_size, 7, 16, 2048]),
              "overlap_schedule": rng.random() < 0.7, "restore_overlap": rng.random() < 0.7}
    # (its own generator: the cases the other draws make stay as they were before "lpm" existed)
    engine["scheduling_policy"] = "lpm" if random.Random(f"lpm {seed}").random() < 0.4 else "fcfs"
    has_l3 = rng.random() < 0.7
    hicache = {"host_ratio": rng.choice([0.1, 0.3, 0.5, 1.0, 2.0, 4.0]),
               "storage_ratio": rng.choice([0.2, 0.5, 1.0, 2.0, 4.0]) if has_l3 else 0.0,
               "write_policy": rng.choice(["write_through", "write_through_selective", "write_back"]),
               "policy": rng.choice(["always", "always", "cost", "never"]),
               "prefetch": rng.random() < 0.7, "whole_first": rng.random() < 0.5,
               "kernel_restore_max_tokens": rng.choice([0, 4096]),
               "storage_checksum": rng.random() < 0.8, "io_workers": rng.choice([1, 2, 4]),
               "transfer_backend": rng.choice(["torch"] * 5 + ["triton"])}  # (triton: interpreted kernels)
    if hicache["policy"] == "cost":
        hicache["recompute_us_per_token"] = rng.choice([1.0, 50.0, 5000.0])
        hicache["restore_explore_every"] = rng.choice([0, 1, 3, 32])
        hicache["learn_outcomes"] = rng.random() < 0.5
    faults = rng.choice(["none", "none", "none", "slow", "all"])
    if faults != "none":
        hicache["io_timeout_s"] = rng.choice([30.0, 0.005, 0.02])  # (a slow read past it fails its restore)
    rounds_mode = rng.choice(["drained", "drained", "overlapping", "restart", "shutdown"])
    flushes = [(rng.choice([None, None, "l1", "l2", "l3", "l1_async"]),
                rng.choice([None, None, None, "l1", "l1_async"])) for _ in range(4)]
    return Case(seed, page_size, num_pages, engine, hicache, requests, faults, rng.randrange(1 << 30), rounds_mode,
                flushes)


async def flush(eng: Engine, what: str | None) -> None:
    if what == "l1_async":
        await eng.cache.flush_async(Tier.L1)
    elif what is not None:
        tier = {"l1": Tier.L1, "l2": Tier.L2, "l3": Tier.L3}[what]
        if tier in eng.cache.tree.allocators:
            eng.cache.flush(tier)


def bound_tokens(requests, i: int) -> int:
    """Most tokens request i's prompt can have (a turn's output part is at most k tokens)."""
    prompt = requests[i].prompt
    if isinstance(prompt, tuple):
        _, parent, k, tail = prompt
        return bound_tokens(requests, parent) + k + len(tail)
    return len(prompt)


async def resolve_turns(case: Case) -> None:
    """Each next turn's prompt from its parent's prompt and the reference's output."""
    while any(isinstance(r.prompt, tuple) for r in case.requests):
        want = await reference([r for r in case.requests if isinstance(r.prompt, list)], case.page_size)
        for r in case.requests:
            parent = case.requests[r.prompt[1]] if isinstance(r.prompt, tuple) else None
            if parent is not None and isinstance(parent.prompt, list) and parent.key() in want:
                r.prompt = parent.prompt + want[parent.key()][:r.prompt[2]] + r.prompt[3]


def make_injector(case: Case) -> FaultInjector | None:
    if case.faults == "none":
        return None
    faults = FaultInjector()
    for i, fault in enumerate(Fault):
        slow = fault in (Fault.SLOW_READ, Fault.SLOW_VERIFY)
        if case.faults == "all" or slow:
            faults.arm(fault, times=None, probability=0.3 if slow else 0.05, seed=case.seed * 31 + i,
                       delay_s=(0.01 if case.seed % 2 else 0.04) if slow else 0.0)
    return faults


def make_engine(case: Case, injector=make_injector) -> Engine:
    # host_ratio applies to L1 pages: keep at least one L2 page (a zero-page L2 is refused elsewhere)
    base = EngineConfig(model="tiny", device="cpu", page_size=case.page_size, num_pages=case.num_pages,
                        **case.engine)
    host_pages = int(case.num_pages * case.hicache["host_ratio"])
    hc = dict(case.hicache)
    if host_pages < 1:
        hc["host_ratio"], host_pages = 1.0, case.num_pages
    if hc["storage_ratio"] and int(host_pages * hc["storage_ratio"]) < 1:  # (at least one L3 page)
        hc["storage_ratio"] = 1.0
    return Engine(base.with_hicache(enable=True, **hc), faults=injector(case))


async def reference(specs, page_size: int) -> dict[tuple, list[int]]:
    """MAX_TOKENS tokens per distinct (prompt, sampling) from an engine without any cache, one
    request at a time (a shorter max_tokens gives a prefix of them: the tiny model has no EOS)."""
    distinct = {s.key(): s for s in specs}
    keys = sorted(distinct)
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=4096, page_size=page_size,
                              enable_prefix_cache=False, max_running_requests=1))
    out = await eng.generate_async([list(k[0]) for k in keys], [distinct[k].reference_params() for k in keys])
    await eng.shutdown()
    return {k: r.output_ids for k, r in zip(keys, out)}


async def run_rounds(case: Case, rounds: int = 2, injector=make_injector, between_rounds=None):
    """Runs the workload `rounds` times through one engine (the later rounds hit what the first
    left in each tier), checking that no request hangs and every tier is whole after each drained
    round; `between_rounds(eng, r, rng)` runs after each drained round's flush. Returns (the engine,
    its results: (index, spec, [(token, logprobs)] per token event, reason, request or None), whether
    it was shut down, the problems so far)."""
    await resolve_turns(case)
    eng = make_engine(case, injector)
    problems: list[str] = []
    results = []

    async def one(i: int, spec: Spec):
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
        if spec.abort is not None:  # ("stop_after_s", s): a caller's stop condition (an API stop string)
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
                eng.status()
                await asyncio.wait_for(flush(eng, mid), RUN_TIMEOUT_S)
            if case.rounds_mode == "restart" or (case.rounds_mode == "shutdown" and last):
                await asyncio.sleep(rng.uniform(0, 0.03))
                if case.rounds_mode == "restart":
                    for _ in range(rng.randrange(1, 4)):  # stopped and started again, 1-3 times
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
                if between_rounds is not None:
                    between_rounds(eng, r, rng)
    except asyncio.TimeoutError:
        problems.append(f"hang in {phase}: {len(results)} requests ended; waiting {len(eng.waiting)} parked "
                        f"{len(eng.parked)} running {len(eng.running)}; " + hang_state(eng))
    finally:
        case.metrics, case.stats = eng.metrics(), dict(eng.stats)
        if not shut:
            await asyncio.wait_for(eng.shutdown(), RUN_TIMEOUT_S)
    return eng, sorted(results, key=lambda r: r[0]), shut, problems


def check_tokens(i: int, spec: Spec, tokens: list[int], reason: str, req, full: list[int], shut: bool,
                 may_fail: bool = False, check_hits: bool = False) -> tuple[list[str], str]:
    """One request's tokens against the reference's `full` output: a finished request's exactly (cut by
    max_tokens and its first stop id), an aborted, stopped, refused-at-shutdown (or, `may_fail`, failed)
    one's a prefix; `check_hits`: a finished one's hits and recomputed tokens cover its prompt. Returns
    (the problems, the request described)."""
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
    elif check_hits and req is not None and sum(req.hit_tokens.values()) + req.recomputed_tokens != len(spec.prompt):
        problems.append(f"request {i}: hits {req.hit_tokens} + recomputed {req.recomputed_tokens} != "
                        f"its {len(spec.prompt)} prompt tokens")
    return problems, why


async def run_case(case: Case, rounds: int = 2) -> list[str]:
    """Runs the workload `rounds` times through one engine; returns what went wrong (empty: nothing)."""
    eng, results, shut, problems = await run_rounds(case, rounds)
    want = await reference(case.requests, case.page_size)
    for i, spec, events, reason, req in results:
        problems += check_tokens(i, spec, [t for t, _ in events], reason, req, want[spec.key()], shut,
                                 check_hits=True)[0]
    return problems


def hang_state(eng: Engine) -> str:
    """What a hung engine holds: its requests' states and ops, the ops in flight, the loop's stack."""
    out = io.StringIO()
    for req in eng.requests.values():
        ops = {n: (op.op_id, op.kind, op.state) for n in ("restore_op", "prefetch_op", "follow_op", "overlap_op")
               if (op := getattr(req, n, None)) is not None}
        print(f"  {req.rid} {req.state} cached {req.cached_len}/{len(req.prompt)} out {len(req.output)} {ops}",
              file=out)
    for op in eng.cache.runner.live.values():
        print(f"  live op {op.op_id} {op.kind} {op.state} rid {op.request_id}", file=out)
    print(f"  stopping {eng.stopping} loop task {eng._loop_task}", file=out)
    if eng._loop_task is not None:  # the chain of awaits the loop is suspended in
        coro = eng._loop_task.get_coro()
        while coro is not None and hasattr(coro, "cr_frame"):
            frame = coro.cr_frame
            if frame is not None:
                print(f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}", file=out)
            coro = coro.cr_await
        print(f"    awaiting {coro!r}", file=out)
    loops = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Engine._loop"]
    print(f"  loop tasks alive: {len(loops)}; engine's: {eng._loop_task in loops}", file=out)
    return out.getvalue()


def describe(case: Case) -> str:
    return (f"seed {case.seed}: page {case.page_size}, L1 {case.num_pages} pages, {case.engine}, {case.hicache}, "
            f"faults {case.faults}, rounds {case.rounds_mode}, {len(case.requests)} requests")


# -- minimised from the fuzz ----------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("max_tokens", [1, 3])
async def test_stop_loop_while_an_overlapped_restore_lands_returns(max_tokens):
    """Regression (fuzz seed 180, `restart` rounds): stop_loop() while a request's L2 restore landed
    layer by layer under its tail's forward. The forward ended before the restore; the loop's next
    tick found it running (so did not stop), then adopted the restore (`settle_overlaps`), which ended
    the request (max_tokens=1), and with nothing left to run waited for a wake-up that never came:
    stop_loop() hung, and so did every later call that waited for it."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=32)
                 .with_hicache(enable=True, policy="always", transfer_backend="torch", storage_ratio=0.0))
    rng = random.Random(7)
    prefix = [rng.randrange(VOCAB) for _ in range(16)]
    prompt = prefix + [rng.randrange(VOCAB)]
    want = (await reference([Spec(prompt, MAX_TOKENS)], 4))[Spec(prompt, MAX_TOKENS).key()][:max_tokens]
    await eng.generate_async([prefix + [1]], SamplingParams(max_tokens=1))
    await eng.stop_loop()
    eng.cache.flush(Tier.L1)  # the prefix is in L2 only
    gate, wait = asyncio.Event(), eng.cache.transfer.wait

    async def held_wait(tr):  # the restore's H2D completes once the gate opens
        await gate.wait()
        return await wait(tr)
    eng.cache.transfer.wait = held_wait
    await eng.start()
    req = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    batches = eng.stats["batches"]
    await until(lambda: req.overlap_op is not None and eng.stats["batches"] > batches)  # its forward ran
    stop = asyncio.ensure_future(eng.stop_loop())
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.wait_for(stop, 10)
    assert eng.stats["restore_overlaps"] == 1 and req.hit_tokens["l2"] == 16
    assert req.state is RequestState.FINISHED and req.output == want
    assert not eng.requests
    assert_whole(eng.cache)
    await eng.shutdown()


async def assert_seed_passes(seed: int, make_case, run_case, describe) -> None:
    case = make_case(seed)
    problems = await run_case(case)
    assert not problems, describe(case) + "\n" + "\n".join(problems)


# -- the fuzz ------------------------------------------------------------------------------------
FUZZ_SEEDS = list(range(24))  # ~20 s here: every rounds mode, fault mode, write and restore policy


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", FUZZ_SEEDS)
async def test_random_workloads_match_a_no_cache_engine(seed):
    await assert_seed_passes(seed, make_case, run_case, describe)


def hunt(make_case, run_case, describe, summary) -> None:
    """By hand: seeds argv[1]..argv[2], three rounds each; prints each case (`summary(case)`, a line or
    None, first), its failures and how many failed. ROUNDS_MODE forces a rounds mode."""
    import traceback

    import uvloop

    import conftest  # noqa: F401  (the test setup: interpreted Triton, one torch thread, quiet logs)

    first, last = int(sys.argv[1]), int(sys.argv[2])
    failed = 0
    for seed in range(first, last + 1):
        case = make_case(seed)
        if os.environ.get("ROUNDS_MODE"):
            case.rounds_mode = os.environ["ROUNDS_MODE"]
        t0 = time.perf_counter()
        try:
            problems = uvloop.run(run_case(case, rounds=3))
        except BaseException as exc:  # noqa: BLE001  (a CancelledError out of the engine too)
            if isinstance(exc, KeyboardInterrupt):
                raise
            problems = ["exception: " + "".join(traceback.format_exception(exc))]
        failed += bool(problems)
        line = summary(case)
        if line:
            print("     " + line, flush=True)
        print(f"{'FAIL' if problems else 'ok  '} {time.perf_counter() - t0:5.1f}s {describe(case)}", flush=True)
        for p in problems:
            print("    " + p, flush=True)
    print(f"{failed} of {last - first + 1} seeds failed", flush=True)


def summary(case: Case) -> str | None:
    m = getattr(case, "metrics", {})
    return m and (f"hits {m['hit_tokens']} evict {m['evictions_pages']} restores {m['restores_done']} "
                  f"failures {m['failures']}")


if __name__ == "__main__":
    MAX_REQUESTS = int(os.environ.get("MAX_REQUESTS", MAX_REQUESTS))
    hunt(make_case, run_case, describe, summary)

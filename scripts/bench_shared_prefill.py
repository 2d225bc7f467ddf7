"""Requests that arrive together with one prefix (n choices of a prompt, a batch of one system prompt): the time to
every first token and the prompt tokens computed, with the engine's shared prefill (a request waits for the pages of
the one computing its prefix: scheduler/admission.py `_computes_prefix_of`) and without it (--disable-shared-prefill's
switch, EngineConfig.share_prefill: each computes its prefix beside the others, as before session 45). Both in one process, alternating.

    python scripts/bench_shared_prefill.py                                  # GPU: qwen3-8b shape
    python scripts/bench_shared_prefill.py --model tiny --device cpu --prompt-tokens 200 --requests 2,4
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_cli import (check_device, check_engine_config, check_fits, fail, int_list,  # noqa: E402
                       non_negative_int, positive_int)
from bench_common import (CPU_SMOKE, add_common_args, fmt, integrity_of, median, parse_common_args,  # noqa: E402
                          sync, table, write_result)
from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402


WARM_TOKENS = 64  # the warm-up's prompt (two requests)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, model=CPU_SMOKE, device=("cuda", "cpu"), seed=0)
    p.add_argument("--prompt-tokens", type=int_list(1), default=[1000, 4000],
                   help="comma-separated shared prompt lengths")
    p.add_argument("--tail-tokens", type=non_negative_int, default=0,
                   help="distinct tokens after the shared prompt (0: n choices)")
    p.add_argument("--requests", type=int_list(1), default=[2, 4, 8],
                   help="comma-separated numbers of requests arriving together")
    p.add_argument("--repeats", type=positive_int, default=3, help="rounds per configuration (each a fresh prompt)")
    args = parse_common_args(p, argv)
    check_device(p, args.device)
    # what the engine would refuse of the requests, refused before the model loads (regression: tracebacks)
    config = check_engine_config(p, lambda: engine_config(args))
    check_fits(p, args.model, [(n + args.tail_tokens, 1, "--prompt-tokens + --tail-tokens")
                               for n in args.prompt_tokens], config.page_size, config.num_pages)
    return args


def engine_config(args) -> EngineConfig:
    cuda = args.device == "cuda"
    return EngineConfig(model=args.model, device=args.device, seed=args.seed, page_size=16 if cuda else 4,
                        num_pages=8192 if cuda else 2048)


async def round_trip(engine: Engine, prompts: list[list[int]], device: str) -> tuple[float, int]:
    """Seconds from submitting the requests together to the last one's first token; prompt tokens computed."""
    before = engine.metrics()["recomputed_tokens"]
    sync(device)
    t0 = time.perf_counter()

    async def first(prompt):
        async for ev in engine.submit(prompt, SamplingParams(max_tokens=1, ignore_eos=True)):
            if ev.finished:
                return time.perf_counter() - t0
    seconds = max(await asyncio.gather(*(first(p) for p in prompts)))
    return seconds, engine.metrics()["recomputed_tokens"] - before


async def main_async(args) -> dict:
    engine = Engine(engine_config(args))
    for n in [WARM_TOKENS] + [n + args.tail_tokens for n in args.prompt_tokens]:  # (the built engine's checks too)
        try:
            engine.validate([1] * n, SamplingParams(max_tokens=1, ignore_eos=True))
        except ValueError as exc:
            fail(f"{exc} (a request of {n} prompt tokens)")
    rng = random.Random(args.seed)
    fresh = lambda n: [rng.randrange(1, engine.vocab_size) for _ in range(n)]  # noqa: E731
    await round_trip(engine, [fresh(WARM_TOKENS)] * 2, args.device)  # (warm-up: graphs, kernels, the loop)
    rows = []
    for n_tokens in args.prompt_tokens:
        for n_requests in args.requests:
            timed = {"shared": [], "apart": []}
            computed = {"shared": [], "apart": []}
            for _ in range(args.repeats):
                for mode in ("shared", "apart"):
                    # (one engine, both ways: --disable-shared-prefill's switch, read at each admission)
                    engine.config = dataclasses.replace(engine.config, share_prefill=mode == "shared")
                    base = fresh(n_tokens)
                    prompts = [base + fresh(args.tail_tokens) for _ in range(n_requests)]
                    seconds, tokens = await round_trip(engine, prompts, args.device)
                    timed[mode].append(seconds)
                    computed[mode].append(tokens)
            rows.append({"prompt_tokens": n_tokens, "tail_tokens": args.tail_tokens, "requests": n_requests,
                         "shared_s": median(timed["shared"]), "apart_s": median(timed["apart"]),
                         "shared_computed_tokens": median(computed["shared"]),
                         "apart_computed_tokens": median(computed["apart"])})
    integrity = integrity_of(engine)
    await engine.shutdown()
    return {"model": args.model, "device": args.device, "repeats": args.repeats, "rows": rows, "integrity": integrity}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = asyncio.run(main_async(args))
    head = ["prompt", "tail", "requests", "last first token s (shared)", "(apart)", "speedup", "computed (shared)",
            "(apart)"]
    body = [[str(r["prompt_tokens"]), str(r["tail_tokens"]), str(r["requests"]), fmt(r["shared_s"], "{:.4f}"),
             fmt(r["apart_s"], "{:.4f}"), fmt(r["apart_s"] / r["shared_s"], "{:.2f}x"),
             f"{r['shared_computed_tokens']:.0f}", f"{r['apart_computed_tokens']:.0f}"] for r in out["rows"]]
    print(table(head, body), file=sys.stderr if args.json else sys.stdout)
    print(f"integrity: {out['integrity']}", file=sys.stderr if args.json else sys.stdout)
    write_result(out, args.out, args.json)
    return 0 if out["integrity"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())

"""Beam search (scheduler/beam_search.py) with the prefix cache and without: what the radix tree saves a search
that re-sends every beam's whole sequence at every step (vLLM V1's design, served the same way here).

For each prompt length and beam width, one search of --max-tokens steps over a fresh random prompt, timed from its
start to its result, in an engine with the prefix cache (L1) and in one without it (each step then recomputes every
beam's whole sequence). Reported per configuration: seconds per search, steps per second, prompt tokens computed
(the engine's recomputed_tokens) against those sent, the beams' agreement between the two engines (bf16 numerics of
a prefill over a cached prefix and of a full one differ in the last bits, so near-ties may rank differently), and a
greedy decode of the same length in the cached engine for scale. Both engines share one loaded model.

    python scripts/bench_beam_search.py                                   # GPU: qwen3-8b shape
    python scripts/bench_beam_search.py --model tiny --device cpu --prompt-tokens 64 --beam-widths 2 --max-tokens 4
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_common import (CPU_SMOKE, add_common_args, fmt, free_memory, integrity_of, median,  # noqa: E402
                          parse_common_args, shared_model, sync, table, write_result)
from scheduler.beam_search import BeamSearchParams, beam_search  # noqa: E402
from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, model=CPU_SMOKE, device=("cuda", "cpu"), seed=0)
    p.add_argument("--prompt-tokens", default="350,2000", help="comma-separated prompt lengths")
    p.add_argument("--beam-widths", default="1,4,8", help="comma-separated beam widths (1..10)")
    p.add_argument("--max-tokens", type=int, default=32, help="steps of each search")
    p.add_argument("--repeats", type=int, default=3, help="searches per configuration (each a fresh prompt)")
    p.add_argument("--num-pages", type=int, default=0, help="L1 pages per engine (0: 4,096 on CUDA, 1,024 on CPU)")
    args = parse_common_args(p, argv)
    args.prompt_tokens = [int(x) for x in args.prompt_tokens.split(",")]
    args.beam_widths = [int(x) for x in args.beam_widths.split(",")]
    return args


def make_engine(args, prefix_cache: bool) -> Engine:
    cuda = args.device == "cuda"
    return Engine(EngineConfig(model=args.model, device=args.device, seed=args.seed, page_size=16 if cuda else 4,
                               num_pages=args.num_pages or (4096 if cuda else 1024),
                               enable_prefix_cache=prefix_cache))


def prompts(args, vocab: int) -> dict[tuple[int, int, int], list[int]]:
    """One fresh prompt per (length, width, repeat), the same for both engines."""
    rng = random.Random(args.seed)
    return {(n, w, r): [rng.randrange(1, vocab) for _ in range(n)]
            for n in args.prompt_tokens for w in args.beam_widths for r in range(args.repeats)}


async def run_engine(engine: Engine, args, todo: dict) -> dict:
    """Each configuration's searches in this engine: seconds, beams, tokens sent and computed."""
    rng = random.Random(args.seed - 1)  # (graphs, kernels and the loop started before anything is timed, on a
    warm = [rng.randrange(1, engine.vocab_size) for _ in range(32)]  # prompt of its own: it leaves no timed hit)
    await beam_search(engine, warm, BeamSearchParams(beam_width=2, max_tokens=2))
    out = {}
    for (n, w, r), prompt in todo.items():
        before = engine.metrics()["recomputed_tokens"]
        sync(args.device)
        t0 = time.perf_counter()
        res = await beam_search(engine, prompt, BeamSearchParams(beam_width=w, max_tokens=args.max_tokens,
                                                                  ignore_eos=True))
        sync(args.device)
        seconds = time.perf_counter() - t0
        # tokens sent: each step re-sends every live beam's sequence (width beams after the first step)
        sent = sum(n + step for step in range(args.max_tokens) for _ in range(1 if step == 0 else w))
        out[(n, w, r)] = {"s": seconds, "beams": [b.output_ids for b in res.beams],
                          "computed_tokens": engine.metrics()["recomputed_tokens"] - before, "sent_tokens": sent}
    return out


async def greedy_s(engine: Engine, prompt: list[int], max_tokens: int) -> float:
    t0 = time.perf_counter()
    async for ev in engine.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
        if ev.finished:
            break
    return time.perf_counter() - t0


async def main_async(args) -> dict:
    results, integrity = {}, {}
    with shared_model():
        for mode, prefix_cache in (("cache", True), ("no_cache", False)):
            engine = make_engine(args, prefix_cache)
            todo = prompts(args, engine.vocab_size)
            results[mode] = await run_engine(engine, args, todo)
            if prefix_cache:
                rng = random.Random(args.seed + 1)
                results["greedy"] = {n: median([await greedy_s(engine, [rng.randrange(1, engine.vocab_size)
                                                                        for _ in range(n)], args.max_tokens)
                                               for _ in range(args.repeats)]) for n in args.prompt_tokens}
            integrity[mode] = integrity_of(engine)
            await engine.shutdown()
            del engine
            free_memory()
    rows = []
    for n in args.prompt_tokens:
        for w in args.beam_widths:
            keys = [(n, w, r) for r in range(args.repeats)]
            on, off = ([results[m][k] for k in keys] for m in ("cache", "no_cache"))
            same = sum(a["beams"] == b["beams"] for a, b in zip(on, off))
            rows.append({"prompt_tokens": n, "beam_width": w, "max_tokens": args.max_tokens,
                         "cache_s": median([x["s"] for x in on]), "no_cache_s": median([x["s"] for x in off]),
                         "cache_computed_tokens": median([x["computed_tokens"] for x in on]),
                         "no_cache_computed_tokens": median([x["computed_tokens"] for x in off]),
                         "sent_tokens": on[0]["sent_tokens"], "beams_equal": f"{same}/{len(keys)}",
                         "greedy_s": results["greedy"][n]})
    return {"model": args.model, "device": args.device, "repeats": args.repeats, "rows": rows,
            "integrity": integrity}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = asyncio.run(main_async(args))
    head = ["prompt", "width", "cache s", "no cache s", "speedup", "steps/s (cache)", "computed / sent (cache)",
            "computed (no cache)", "greedy s", "beams equal"]
    body = [[str(r["prompt_tokens"]), str(r["beam_width"]), fmt(r["cache_s"], "{:.3f}"), fmt(r["no_cache_s"], "{:.3f}"),
             fmt(r["no_cache_s"] / r["cache_s"], "{:.2f}x"), fmt(r["max_tokens"] / r["cache_s"], "{:.1f}"),
             f"{r['cache_computed_tokens']:.0f} / {r['sent_tokens']}", f"{r['no_cache_computed_tokens']:.0f}",
             fmt(r["greedy_s"], "{:.3f}"), r["beams_equal"]] for r in out["rows"]]
    print(table(head, body), file=sys.stderr if args.json else sys.stdout)
    print(f"integrity: {out['integrity']}", file=sys.stderr if args.json else sys.stdout)
    write_result(out, args.out, args.json)
    return 0 if all(v == "passed" for v in out["integrity"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

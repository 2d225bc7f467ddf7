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
from bench_cli import (check_device, check_engine_config, check_fits, fail, int_list,  # noqa: E402
                       non_negative_int, positive_int, refused_as_usage)
from bench_common import (CPU_SMOKE, add_common_args, fmt, free_memory, integrity_of, median,  # noqa: E402
                          parse_common_args, shared_model, sync, table, write_result)
from scheduler.beam_search import MAX_BEAM_WIDTH, BeamSearchParams, beam_search  # noqa: E402
from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402


WARM_TOKENS = 32  # the warm-up search's prompt (2 beams, 2 steps)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, model=CPU_SMOKE, device=("cuda", "cpu"), seed=0)
    p.add_argument("--prompt-tokens", type=int_list(1), default=[350, 2000], help="comma-separated prompt lengths")
    p.add_argument("--beam-widths", type=int_list(1), default=[1, 4, 8],
                   help=f"comma-separated beam widths (1..{MAX_BEAM_WIDTH})")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="steps of each search")
    p.add_argument("--repeats", type=positive_int, default=3, help="searches per configuration (each a fresh prompt)")
    p.add_argument("--num-pages", type=non_negative_int, default=0,
                   help="L1 pages per engine (0: 4,096 on CUDA, 1,024 on CPU)")
    args = parse_common_args(p, argv)
    check_device(p, args.device)
    # what the engine would refuse of the searches, refused before the model loads (regression: tracebacks)
    if max(args.beam_widths) > MAX_BEAM_WIDTH:
        p.error(f"--beam-widths: each width must be in [1, {MAX_BEAM_WIDTH}] (each step asks 2 * width logprobs), "
                f"got {max(args.beam_widths)}")
    config = check_engine_config(p, lambda: engine_config(args, True))
    with refused_as_usage(p, "--max-tokens"):
        SamplingParams(max_tokens=args.max_tokens, ignore_eos=True).validate(config.max_new_tokens_limit)
    shapes = [(n, args.max_tokens, "--prompt-tokens/--max-tokens") for n in args.prompt_tokens]
    check_fits(p, args.model, [*shapes, (WARM_TOKENS, 2, "the warm-up search (--num-pages)")], config.page_size,
               config.num_pages)
    return args


def engine_config(args, prefix_cache: bool) -> EngineConfig:
    cuda = args.device == "cuda"
    return EngineConfig(model=args.model, device=args.device, seed=args.seed, page_size=16 if cuda else 4,
                        num_pages=args.num_pages or (4096 if cuda else 1024), enable_prefix_cache=prefix_cache)


def make_engine(args, prefix_cache: bool) -> Engine:
    engine = Engine(engine_config(args, prefix_cache))
    searches = [(WARM_TOKENS, 2, 2)] + [(n, w, args.max_tokens) for n in args.prompt_tokens for w in args.beam_widths]
    for n, w, steps in searches:  # (the built engine's own checks too: pages CUDA graphs hold, --max-prompt-tokens)
        try:
            BeamSearchParams(beam_width=w, max_tokens=steps, ignore_eos=True).validate(engine, [1] * n)
        except ValueError as exc:
            fail(f"{exc} (a search of {n} prompt tokens, width {w}, {steps} steps)")
    return engine


def prompts(args, vocab: int) -> dict[tuple[int, int, int], list[int]]:
    """One fresh prompt per (length, width, repeat), the same for both engines."""
    rng = random.Random(args.seed)
    return {(n, w, r): [rng.randrange(1, vocab) for _ in range(n)]
            for n in args.prompt_tokens for w in args.beam_widths for r in range(args.repeats)}


async def run_engine(engine: Engine, args, todo: dict) -> dict:
    """Each configuration's searches in this engine: seconds, beams, tokens sent and computed."""
    rng = random.Random(args.seed - 1)  # (graphs, kernels and the loop started before anything is timed, on a
    warm = [rng.randrange(1, engine.vocab_size) for _ in range(WARM_TOKENS)]  # prompt of its own: no timed hit)
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

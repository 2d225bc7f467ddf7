"""What preemption buys where clients ask for far more tokens than they use (a chat without max_tokens gets the rest of
its context): requests arriving together, each with a large max_tokens, stopping at a sampled stop token after a
geometric number of tokens (a random set of --mean-output-tokens' share of the vocabulary as stop_token_ids, seeded
sampling). Per --decode-reserve-ratio (EngineConfig.decode_reserve_ratio: the share of max_tokens admission reserves;
1 reserves it all and preempts nothing; auto adapts it as SGLang does), one engine switched between them: the wall
time to the last token (the longest answer's decode bounds it), output tokens/s over it, the requests' latency to their last token, the most
requests running at once, preemptions, and how many requests streamed the same tokens as at the
first ratio (all on the CPU, where tests/test_preemption.py checks it; on the GPU a decode batch's size changes its
kernels' rounding, and a sampled stream may part at a near-tie).

    python scripts/bench_preemption.py                                       # GPU: qwen3-8b shape, L1 65,536 tokens
    python scripts/bench_preemption.py --device cpu --requests 16 --prompt-tokens 32 --max-tokens 256 \\
        --mean-output-tokens 48 --l1-tokens 2048
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_cli import check_device, check_engine_config, check_fits, positive_int, refused_as_usage  # noqa: E402
from bench_common import (CPU_SMOKE, add_common_args, fmt, integrity_of, median, parse_common_args,  # noqa: E402
                          percentile, sync, table, write_result)
from hicache.radix import Tier  # noqa: E402
from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402


def ratio_list(text: str) -> list[float | str]:
    """An argparse type: a comma list of ratios in [0, 1] or "auto"."""
    try:
        values = [item if item == "auto" else float(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers in [0, 1] or 'auto', got {text!r}") \
            from None
    if not all(v == "auto" or 0.0 <= v <= 1.0 for v in values):  # (also NaN)
        raise argparse.ArgumentTypeError(f"each ratio must be in [0, 1] or 'auto', got {text!r}")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, model=CPU_SMOKE, device=("cuda", "cpu"), seed=0)
    p.add_argument("--ratios", type=ratio_list, default=[1.0, 0.3, 0.1, "auto"],
                   help="comma list of --decode-reserve-ratio (numbers in [0, 1] or auto)")
    p.add_argument("--requests", type=positive_int, default=128, help="requests arriving together")
    p.add_argument("--prompt-tokens", type=positive_int, default=512)
    p.add_argument("--max-tokens", type=positive_int, default=2048, help="each request's max_tokens")
    p.add_argument("--mean-output-tokens", type=positive_int, default=256,
                   help="mean tokens a request generates before its stop token (geometric)")
    p.add_argument("--l1-tokens", type=positive_int, default=0, help="L1 capacity (default 65,536 on CUDA, 4,096 "
                   "on the CPU)")
    p.add_argument("--max-running-requests", type=positive_int, default=256)
    p.add_argument("--l2", action="store_true", help="hicache on (L2 twice L1): a preempted request L1 evicted resumes "
                   "from L2")
    p.add_argument("--repeats", type=positive_int, default=2, help="rounds per ratio (alternating)")
    args = parse_common_args(p, argv)
    check_device(p, args.device)
    config = check_engine_config(p, lambda: engine_config(args))
    with refused_as_usage(p, "--max-tokens"):
        SamplingParams(max_tokens=args.max_tokens).validate(config.max_new_tokens_limit)
    check_fits(p, args.model, [(args.prompt_tokens, args.max_tokens, "--prompt-tokens, --max-tokens")],
               config.page_size, config.l1_pages(config.page_size))
    return args


def engine_config(args) -> EngineConfig:
    cuda = args.device == "cuda"
    config = EngineConfig(model=args.model, device=args.device, seed=args.seed, page_size=16 if cuda else 4,
                          max_total_tokens=args.l1_tokens or (65536 if cuda else 4096),
                          max_running_requests=args.max_running_requests)
    return config.with_hicache(enable=True, host_ratio=2.0) if args.l2 else config


async def one_round(engine: Engine, prompts, params, device: str) -> dict:
    """Every request at once; seconds to the last token, the tokens each streamed, the most running at once."""
    peak, launch = [0], engine._launch

    def counted(work, chain=None):
        peak[0] = max(peak[0], len(engine.running))
        return launch(work, chain)
    engine._launch = counted
    preempted = engine.stats["preempted"]
    sync(device)
    t0 = time.perf_counter()

    async def tokens_of(prompt, sp):
        out = []
        async for ev in engine.submit(prompt, sp):
            if ev.token_id is not None:
                out.append(ev.token_id)
            if ev.finished and ev.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"a request ended {ev.finish_reason}: {ev.error}")
        return out, time.perf_counter() - t0
    done = await asyncio.gather(*(tokens_of(p, sp) for p, sp in zip(prompts, params)))
    seconds = time.perf_counter() - t0
    del engine._launch  # (the instance's wrapper goes: the class's method again)
    return {"seconds": seconds, "outputs": [out for out, _ in done], "latency_s": [s for _, s in done],
            "peak_running": peak[0], "preempted": engine.stats["preempted"] - preempted}


def ratio_row(ratio, rounds: list[dict], reference: list[list[int]]) -> dict:
    """One ratio's row over its rounds (one_round's): the medians of its rounds; tokens/s each round's own tokens
    over its own seconds (regression: the first round's tokens over the median round's seconds, where sampled
    streams that parted made the rounds' token counts differ)."""
    tokens = sum(len(o) for o in rounds[0]["outputs"])
    return {"ratio": ratio, "seconds": median([r["seconds"] for r in rounds]), "output_tokens": tokens,
            "tokens_per_s": median([sum(len(o) for o in r["outputs"]) / r["seconds"] for r in rounds]),
            "latency_p50_s": median([percentile(r["latency_s"], 50) for r in rounds]),
            "latency_p90_s": median([percentile(r["latency_s"], 90) for r in rounds]),
            "peak_running": max(r["peak_running"] for r in rounds),
            "preempted": median([r["preempted"] for r in rounds]),
            "same_outputs": min(sum(a == b for a, b in zip(r["outputs"], reference)) for r in rounds)}


async def main_async(args) -> dict:
    engine = Engine(engine_config(args))
    rng = random.Random(args.seed)
    vocab = engine.vocab_size
    stops = tuple(rng.sample(range(1, vocab), max(1, round(vocab / args.mean_output_tokens))))
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed + i, stop_token_ids=stops)
              for i in range(args.requests)]
    await one_round(engine, prompts[:2], params[:2], args.device)  # (warm-up: graphs, kernels, the loop)
    runs = {r: [] for r in args.ratios}
    for _ in range(args.repeats):
        for ratio in args.ratios:
            await engine.cache.drain()
            engine.cache.flush(Tier.L1)  # (every round computes its prompts: none is a hit of the round before)
            engine.config = dataclasses.replace(engine.config, decode_reserve_ratio=ratio)  # (read at each admission)
            runs[ratio].append(await one_round(engine, prompts, params, args.device))
    reference = runs[args.ratios[0]][0]["outputs"]
    rows = [ratio_row(ratio, rounds, reference) for ratio, rounds in runs.items()]
    integrity = integrity_of(engine)
    await engine.shutdown()
    return {"model": args.model, "device": args.device, "l2": args.l2, "requests": args.requests,
            "prompt_tokens": args.prompt_tokens, "restores_done": engine.metrics()["restores_done"],
            "max_tokens": args.max_tokens, "mean_output_tokens": args.mean_output_tokens,
            "l1_tokens": engine.config.l1_pages(engine.page_size) * engine.page_size, "repeats": args.repeats,
            "rows": rows, "integrity": integrity}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = asyncio.run(main_async(args))
    base = out["rows"][0]["seconds"]
    head = ["reserve ratio", "seconds", "output tokens", "tok/s", "x first", "latency p50 / p90 s", "peak running",
            "preempted", "same tokens as first"]
    body = [[str(r["ratio"]), fmt(r["seconds"], "{:.3f}"), str(r["output_tokens"]), fmt(r["tokens_per_s"], "{:.0f}"),
             fmt(base / r["seconds"], "{:.2f}x"), f"{r['latency_p50_s']:.2f} / {r['latency_p90_s']:.2f}",
             str(r["peak_running"]), f"{r['preempted']:.0f}",
             f"{r['same_outputs']} of {out['requests']}"] for r in out["rows"]]
    human = sys.stderr if args.json else sys.stdout
    print(f"{out['requests']} requests of {out['prompt_tokens']} prompt tokens, max_tokens {out['max_tokens']}, "
          f"~{out['mean_output_tokens']} tokens each; L1 {out['l1_tokens']:,} tokens"
          + (f", L2 on ({out['restores_done']} restores)" if out["l2"] else ""), file=human)
    print(table(head, body), file=human)
    print(f"integrity: {out['integrity']}", file=human)
    write_result(out, args.out, args.json)
    return 0 if out["integrity"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())

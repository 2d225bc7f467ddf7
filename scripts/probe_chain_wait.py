"""Decode of more requests than fit: chained while others wait for a slot or for L1 room, or not. (GPU only.)

`Admission.chain_decode_batch` used to end the decode chain whenever a request waited, though one that
waits for a running slot (max_running_requests reached) is admitted only once another finishes: a
saturated engine ran every decode step unchained (session 38). One that waits for L1 room, which comes
back only as another finishes, did the same until session 39. This times the same workload with the
kept rule ("new") and the old one ("old", patched in for the timing), alternating in one process:
`--requests` greedy requests of `--prompt-tokens` random tokens, `--slots` at a time (`--wait-for slot`:
max_running_requests; `memory`: an L1 that holds that many), `--new-tokens` each, every round's prompts
new (no prefix cache hit), tokens/s from submit to the last token.

    python3 scripts/probe_chain_wait.py [--model qwen3-8b] [--wait-for memory] [--rounds 4]
    (smoke: --model tiny --device cpu)
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cli import (check_engine_config, check_fits, fail, positive_int, refused_as_usage,  # noqa: E402
                       request_errors)
from scheduler import admission  # noqa: E402
from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

KEPT = admission.Admission.chain_decode_batch


def unchained_while_waiting(self, reqs):
    """The rule before session 38: no chained step while any request waits."""
    return None if self.engine.waiting else KEPT(self, reqs)


def unchained_while_blocked(self, reqs):
    """The rule before session 39: a request that no L1 room could take ends the chain."""
    blocked, self.memory_blocked = self.memory_blocked, None
    try:
        return KEPT(self, reqs)
    finally:
        self.memory_blocked = blocked


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke run (--model tiny), not a timing")
    p.add_argument("--requests", type=positive_int, default=48)
    p.add_argument("--slots", type=positive_int, default=16, help="requests that run at a time")
    p.add_argument("--wait-for", choices=["slot", "memory"], default="slot",
                   help="what holds the others back: max_running_requests, or an L1 of that many requests' pages")
    p.add_argument("--prompt-tokens", type=positive_int, default=128)
    p.add_argument("--new-tokens", type=positive_int, default=128)
    p.add_argument("--rounds", type=positive_int, default=4)
    args = p.parse_args(argv)
    # what the engine would refuse, refused before the model loads (regression: every request failed, 0 tokens/s,
    # exit 0; --slots 0 was the default L1)
    args.config = check_engine_config(p, lambda: engine_config(args))
    with refused_as_usage(p, "--new-tokens"):
        params(args).validate(args.config.max_new_tokens_limit)
    check_fits(p, args.model, [(args.prompt_tokens, args.new_tokens, "--prompt-tokens + --new-tokens")],
               args.config.page_size, args.config.num_pages or None)  # (0: sized by max_total_tokens)
    return args


PAGE = 16


def request_pages(args) -> int:
    return -(-(args.prompt_tokens + args.new_tokens - 1) // PAGE)


def engine_config(args) -> EngineConfig:
    limit = (dict(max_running_requests=args.slots, max_total_tokens=200_000) if args.wait_for == "slot" else
             dict(max_running_requests=max(64, args.requests), num_pages=args.slots * request_pages(args)))
    return EngineConfig(model=args.model, device=args.device, page_size=PAGE, max_prefill_tokens=16384, **limit)


def params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("probe_chain_wait.py needs CUDA", file=sys.stderr)
        return 2
    eng = Engine(args.config)
    warm = SamplingParams(max_tokens=min(4, args.new_tokens), ignore_eos=True)  # (within a request's pages)
    try:  # (the built engine's own checks too: pages CUDA graphs hold)
        eng.validate([1] * args.prompt_tokens, params(args))
    except ValueError as exc:
        fail(str(exc))
    old_rule = unchained_while_waiting if args.wait_for == "slot" else unchained_while_blocked
    rng = random.Random(0)
    lo, hi = min(1000, eng.vocab_size // 2), min(100_000, eng.vocab_size)  # (no special tokens)
    request_errors(eng.generate([[rng.randrange(lo, hi) for _ in range(args.prompt_tokens)]
                                 for _ in range(args.slots)], warm), "warm-up requests")  # (the graphs' capture)
    rates: dict[str, list[float]] = {"new": [], "old": []}
    try:  # (the kept rule back, also where a round fails)
        for rnd in range(args.rounds):
            for name, rule in (("new", KEPT), ("old", old_rule)):
                admission.Admission.chain_decode_batch = rule
                prompts = [[rng.randrange(lo, hi) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
                chained = eng.stats["chained_steps"]
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                results = eng.generate(prompts, params(args))
                seconds = time.perf_counter() - t
                request_errors(results)  # (regression: failed requests were timed as 0 tokens/s, exit 0)
                rates[name].append(sum(len(r.output_ids) for r in results) / seconds)
                print(f"round {rnd} {name}: {rates[name][-1]:,.0f} tokens/s, "
                      f"{eng.stats['chained_steps'] - chained} chained steps", flush=True)
    finally:
        admission.Admission.chain_decode_batch = KEPT
    eng.check_integrity()
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):,.0f} tokens/s ({', '.join(f'{v:,.0f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

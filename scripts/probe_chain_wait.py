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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (--model tiny), not a timing")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--slots", type=int, default=16, help="requests that run at a time")
    p.add_argument("--wait-for", choices=["slot", "memory"], default="slot",
                   help="what holds the others back: max_running_requests, or an L1 of that many requests' pages")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("probe_chain_wait.py needs CUDA", file=sys.stderr)
        return 2
    request_pages = -(-(args.prompt_tokens + args.new_tokens - 1) // 16)
    limit = (dict(max_running_requests=args.slots, max_total_tokens=200_000) if args.wait_for == "slot" else
             dict(max_running_requests=max(64, args.requests), num_pages=args.slots * request_pages))
    eng = Engine(EngineConfig(model=args.model, device=args.device, page_size=16, max_prefill_tokens=16384, **limit))
    old_rule = unchained_while_waiting if args.wait_for == "slot" else unchained_while_blocked
    rng = random.Random(0)
    lo, hi = min(1000, eng.vocab_size // 2), min(100_000, eng.vocab_size)  # (no special tokens)
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    eng.generate([[rng.randrange(lo, hi) for _ in range(args.prompt_tokens)] for _ in range(args.slots)],
                 SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up: the graphs' capture
    rates: dict[str, list[float]] = {"new": [], "old": []}
    for rnd in range(args.rounds):
        for name, rule in (("new", KEPT), ("old", old_rule)):
            admission.Admission.chain_decode_batch = rule
            prompts = [[rng.randrange(lo, hi) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
            chained = eng.stats["chained_steps"]
            if args.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            results = eng.generate(prompts, params)
            seconds = time.perf_counter() - t
            rates[name].append(sum(len(r.output_ids) for r in results) / seconds)
            print(f"round {rnd} {name}: {rates[name][-1]:,.0f} tokens/s, "
                  f"{eng.stats['chained_steps'] - chained} chained steps", flush=True)
    admission.Admission.chain_decode_batch = KEPT
    eng.check_integrity()
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):,.0f} tokens/s ({', '.join(f'{v:,.0f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

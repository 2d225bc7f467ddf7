"""Does a restored prefix behave exactly like the same prefix kept in L1?

For two prompts it runs: a full recompute (no tier holds the prompt), an L1 hit of the same prompt, then
alternating requests whose prefix is evicted from L1 and restored from L2. It checks that the restored
KV is byte-identical to the KV the recompute wrote and that every restored request's first token
equals the L1-hit request's (same KV, same kernels). Recompute may differ from both in bf16: a full
prefill and a short tail over cached KV round differently, and random weights have near-tied logits.

    python3 scripts/check_restore_equivalence.py --model qwen3-8b --prefix-tokens 1000
    python3 scripts/check_restore_equivalence.py --model tiny --device cpu --prefix-tokens 64   # CPU smoke
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys

import torch

from bench_cli import (check_device, fail, non_negative_float, non_negative_int, positive_float,  # noqa: E402
                       positive_int, refused_as_usage)
from bench_common import add_common_args
from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams


def engine_config(args) -> EngineConfig:
    return EngineConfig(model=args.model, device=args.device, page_size=args.page_size,
                        num_pages=args.num_pages, max_prefill_tokens=16384,
                        cuda_graphs=not args.disable_cuda_graphs).with_hicache(
        enable=True, policy="always", host_ratio=args.host_ratio, storage_ratio=args.storage_ratio)


async def run(args) -> int:
    eng = Engine(engine_config(args))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, eng.vocab_size) for _ in range(args.prefix_tokens + 1)] for _ in range(2)]
    try:  # (regression: an IndexError from a refused request's missing token)
        eng.validate(prompts[0], SamplingParams(max_tokens=1))
    except ValueError as exc:
        fail(str(exc))

    async def first_token(p):
        out = (await eng.generate_async([p], SamplingParams(max_tokens=1)))[0]
        await eng.cache.drain()
        return out.output_ids[0], out.cached_tokens

    def prefix_kv(p):
        m = eng.cache.match(p[:-1])
        idx = torch.tensor(m.pages[Tier.L1], device=eng.device)
        return eng.cache.l1.kv[:, :, idx].view(torch.uint8).clone()

    await eng.start()
    ref, l1, kv = [], [], []
    # (regression: L1 and L2 were emptied before each prompt, which dropped prompt 0's L2 copy, and
    # iteration 0 was a recompute.) The tiers start empty and the random prompts share no page, so
    # each first request is a full recompute without emptying anything.
    for p in prompts:
        token, cached = await first_token(p)
        if sum(cached.values()):
            print(f"prompt {len(ref)}'s reference request hit {cached}: not a full recompute", file=sys.stderr)
            await eng.stop_loop()
            return 1
        ref.append(token)
        kv.append(prefix_kv(p))
        l1.append((await first_token(p))[0])
    ok_tokens = ok_kv = restored = 0
    for i in range(args.iterations):
        eng.cache.tree.evict(Tier.L1, 10 ** 9)
        token, cached = await first_token(prompts[i % 2])
        if cached["l2"] + cached["l3"] == 0:  # recomputed: its KV and token say nothing of a restore
            continue
        restored += 1
        ok_tokens += token == l1[i % 2]
        ok_kv += bool(torch.equal(prefix_kv(prompts[i % 2]), kv[i % 2]))
    eng.check_integrity()
    await eng.stop_loop()
    print(f"{args.model} graphs={not args.disable_cuda_graphs} prefix={args.prefix_tokens}: recompute first tokens "
          f"{ref}, L1-hit {l1}; {restored}/{args.iterations} restored from L2/L3; restored KV byte-identical "
          f"{ok_kv}/{args.iterations}; first token == L1-hit {ok_tokens}/{args.iterations}")
    if restored < args.iterations:
        print(f"only {restored} of {args.iterations} iterations restored their prefix from L2/L3 (the others "
              f"recomputed it); L2/L3 too small?", file=sys.stderr)
    return 0 if restored == ok_tokens == ok_kv == args.iterations else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, model="qwen3-8b", device=True, page_size=16, seed=1, output=False)  # (a line, no JSON)
    ap.add_argument("--prefix-tokens", type=positive_int, default=1000, help="at least a page")
    ap.add_argument("--num-pages", type=non_negative_int, default=0)
    ap.add_argument("--iterations", type=positive_int, default=8)  # (regression: 0 printed 0/0, rc 0)
    ap.add_argument("--host-ratio", type=positive_float, default=4.0)
    ap.add_argument("--storage-ratio", type=non_negative_float, default=0.0,
                    help="> 0 keeps an L3 (write-through, prefetch)")
    ap.add_argument("--disable-cuda-graphs", action="store_true")
    args = ap.parse_args(argv)
    check_device(ap, args.device)
    if args.page_size < 1:  # (regression: ZeroDivisionError)
        ap.error(f"--page-size must be >= 1, got {args.page_size}")
    if args.prefix_tokens < args.page_size:  # (regression: a prefix of no whole page: an index error)
        ap.error(f"--prefix-tokens {args.prefix_tokens} must be at least a page ({args.page_size} tokens)")
    if not args.num_pages:
        args.num_pages = 3 * (-(-(args.prefix_tokens + 2) // args.page_size)) // 2  # ~1.5 prompts
    with refused_as_usage(ap, "engine config"):
        engine_config(args)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

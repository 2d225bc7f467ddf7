"""Throughput under rotating prefixes (the reference's stress workload), and decode speed with
write-through backups running.

Throughput: `--num-prefixes` seeded random prefixes of `--prefix-tokens` tokens rotate; request i is
prefix (i % num_prefixes) plus a unique one-token suffix, greedy, `--max-tokens` output tokens;
`--batch-size` requests are in flight at once. L1 (`--num-pages`) holds about two prefixes by
default, so a rotation never hits L1 and every reuse comes from the tier under test:
  none  hicache off (plain radix prefix cache in L1: recompute);
  l2    L2 only (storage ratio 0), L2 sized to hold every prefix (default host ratio);
  l3    L2 = L1 (host ratio 1) and L3 = 8 x L2 (storage ratio 8), so prefixes live in L3;
  l2small  L2 only, with the l3 tier's L2 (host ratio 1): what the same host memory does without a
        storage tier, the baseline that a warm L3 must beat.
`--tiers none,l2,l3` runs them in sequence in one process (one loaded model, one Engine each) and
checks that every tier produced the same tokens; a single tier is checked against a recompute
reference run (hicache off, prefix cache off). Reports req/s, p50/p95/p99 latency, hit tokens per
tier, recomputed tokens, bytes moved per direction and the integrity check.

Decode (`--decode-batch 32 --decode-tokens 64`): 32 concurrent requests with distinct
`--prefix-tokens`-token prompts generate 64 tokens each, once with hicache on (`--decode-tier l2`,
policy always: write-through D2H backups of every prefill run during decode; l3 adds H2S file
writes) and once with
hicache off; reports decode tokens/s of each (generated tokens after the first, over the time from
the last first token to the last finish) and the ratio on / off, and each pass's steps (median,
p90, max, and the steps over 1.25 x the median: where a pass lost its time) and first-token times.
`--decode-policy never` keeps hicache on, tiers and all, but backs nothing up. Each engine first
runs one warm-up pass of the same shape.

Examples:
    python scripts/bench_hicache_stress.py --model tiny --device cpu --tiers none,l2,l3 --requests 24
    python scripts/bench_hicache_stress.py --tiers none,l2,l3 --policy cost --json --out out/stress.json
    python scripts/bench_hicache_stress.py --tier l3 --policy always --num-pages 512 --page-size 1 \\
        --host-ratio 1 --storage-ratio 8
    python scripts/bench_hicache_stress.py --decode-only --decode-batch 32 --decode-tokens 64

With `--json`, stdout carries only JSON and the human table goes to stderr. Exit status 1 when
outputs differ or the integrity check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cli import (STORAGE_PATH_HELP, check_device, check_engine_config, check_storage_path,  # noqa: E402
                       choice_list, non_negative_float, non_negative_int, positive_float, positive_int)
from bench_common import (CPU_SMOKE, BenchDir, add_common_args, add_engine_mode_args, close_engine,  # noqa: E402
                          parse_common_args, hicache_override_args, engine_mode_args, device_read_gib_s, forward_read_bytes, directions_summary, emit, evict, fmt, fmt_bytes, free_memory,
                          host_profile, integrity_of, median, metrics_delta, ms_summary, note, percentile, shared_model, table)


TIERS = ("none", "l2", "l2small", "l3")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, model=CPU_SMOKE, device=("cuda", "cpu"), page_size=0, seed=0)
    p.add_argument("--tier", default=None, choices=["none", "l2", "l2small", "l3"],
                   help="one tier (same as --tiers X; not with --tiers)")
    p.add_argument("--tiers", type=choice_list(TIERS), default=None,
                   help="comma list run in sequence (default none,l2,l3)")
    p.add_argument("--policy", default="cost", choices=["always", "cost"])
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=350)
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=1, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--warmup", type=non_negative_int, default=8, help="warm-up requests on other prefixes (then all tiers emptied)")
    p.add_argument("--num-pages", type=non_negative_int, default=0, help="L1 pages (default: about two prefixes)")
    p.add_argument("--host-ratio", type=positive_float, default=None, help="default: l2 all prefixes fit, l3 1.0")
    p.add_argument("--storage-ratio", type=non_negative_float, default=8.0, help="L3 = ratio x L2 pages (l3 tier)")
    p.add_argument("--io-workers", type=positive_int, default=4)
    p.add_argument("--disable-checksum", action="store_true")
    p.add_argument("--storage-path", default=None, help=STORAGE_PATH_HELP)
    p.add_argument("--decode-batch", type=non_negative_int, default=0,
                   help="also run the decode comparison with this batch")
    p.add_argument("--decode-tokens", type=positive_int, default=64)
    p.add_argument("--decode-tier", default="l2", choices=["l2", "l3"])
    p.add_argument("--decode-repeats", type=positive_int, default=3, help="measured passes per engine (median)")
    p.add_argument("--decode-policy", default="always", choices=["always", "never"],
                   help="the decode run's hicache policy: always backs every prefill up (the traffic under "
                        "test); never keeps the tiers but writes nothing (hicache's cost without backups)")
    p.add_argument("--decode-only", action="store_true", help="skip the throughput runs")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="after the measured requests, 4 more under torch.profiler: DIR/<tier>.json.gz chrome trace. "
                        "The profiler's hooks stay in the process and slow its CUDA calls (a graph replay's host "
                        "time 3-9x, session 26): later tiers' figures are for reading the trace, not for the record")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the measured requests of each tier (host time per function, to stderr and JSON)")
    add_engine_mode_args(p)
    args = parse_common_args(p, argv)
    for name in ("num_prefixes", "prefix_tokens", "requests", "batch_size", "max_tokens"):  # (regression: a
        if getattr(args, name) < 1:  # batch of 0 hung on its semaphore; 0 requests or prefixes divided by zero)
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.tier and args.tiers:  # (regression: --tier silently won)
        p.error("--tier and --tiers both name the tiers: give one")
    # (regression: --tiers '' ran only the hidden reference engine: an empty table, outputs_match True, rc 0)
    args.tier_list = [args.tier] if args.tier else args.tiers or ["none", "l2", "l3"]
    if args.decode_only and not args.decode_batch:
        args.decode_batch = 32
    check_device(p, args.device)
    check_storage_path(p, args.storage_path)  # (regression: a directory or a missing one: a traceback)
    for tier in set(args.tier_list) | ({args.decode_tier, "none"} if args.decode_batch else set()):
        check_engine_config(p, lambda: engine_config(args, tier, args.num_pages or 64, args.host_ratio or 1.0,
                                                     args.storage_path or "l3.kv"))
    return args


def page_size_of(args) -> int:
    return args.page_size or (16 if args.device == "cuda" else 4)


def engine_config(args, tier: str, num_pages: int, host_ratio: float, storage_path: str | None,
                  prefix_cache: bool = True):
    from scheduler.config import EngineConfig

    cfg = EngineConfig(model=args.model, device=args.device, seed=args.seed, page_size=page_size_of(args),
                       num_pages=num_pages, enable_prefix_cache=prefix_cache,
                       cuda_graphs=not args.disable_cuda_graphs, log_json=args.log_json,
                       restore_overlap=not args.disable_restore_overlap, **engine_mode_args(args))
    return cfg.with_hicache(
        enable=tier not in ("none", "reference"), policy=args.policy, host_ratio=host_ratio,
        storage_ratio=args.storage_ratio if tier == "l3" else 0.0, storage_path=storage_path if tier == "l3" else None,
        io_workers=args.io_workers, storage_checksum=not args.disable_checksum, **hicache_override_args(args))


async def timed(engine, prompt: list[int], max_tokens: int) -> dict:
    """Stream one greedy request: output ids, first-token and finish times (perf_counter)."""
    from scheduler.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rec = {"ids": [], "times": [], "start": time.perf_counter(), "first": None, "end": None, "error": None}
    try:
        async for ev in engine.submit(prompt, params):
            if ev.token_id is not None:
                if rec["first"] is None:
                    rec["first"] = time.perf_counter()
                    rec["pending_backups"] = engine.cache.runner.pending_counts()["backups"]
                rec["ids"].append(ev.token_id)
                rec["times"].append(time.perf_counter())
            if ev.finished:
                rec["error"] = ev.error
    except Exception as exc:  # a rejected request is a failed request, not a crashed benchmark
        rec["error"] = repr(exc)
    rec["end"] = time.perf_counter()
    return rec


async def run_batch(engine, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)

    async def one(p):
        async with sem:
            return await timed(engine, p, max_tokens)
    return await asyncio.gather(*(one(p) for p in prompts))


def rotating_prompts(args, vocab: int, salt: int, count: int) -> list[list[int]]:
    rng = random.Random(args.seed * 7919 + salt)
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_tokens)] for _ in range(args.num_prefixes)]
    suffixes = rng.sample(range(vocab), min(count, vocab)) if count <= vocab else [rng.randrange(vocab)
                                                                                      for _ in range(count)]
    return [prefixes[i % args.num_prefixes] + [suffixes[i]] for i in range(count)]


async def throughput(args, tier: str, prompts, warm, bdir: BenchDir, reference: list | None = None) -> dict:
    """One engine over the workload. With `reference` (the recompute outputs), every request whose
    output differs is run twice more on the same engine, the second time with its prefix in L1: a
    restore must reproduce that L1-hit output exactly (same KV, same kernels), while in bf16 a full
    recompute may round differently where the logits are nearly tied."""
    from scheduler.engine import Engine

    ps = page_size_of(args)
    prefix_pages = -(-(args.prefix_tokens + 1 + args.max_tokens) // ps)
    num_pages = args.num_pages or 2 * prefix_pages + 2
    host_ratio = args.host_ratio
    if host_ratio is None:
        host_ratio = (args.num_prefixes + 1) * prefix_pages / num_pages if tier == "l2" else 1.0
    eng = Engine(engine_config(args, tier, num_pages, host_ratio, bdir.l3_path(tier),
                               prefix_cache=tier != "reference"))
    try:
        await eng.start()
        if warm:
            await run_batch(eng, warm, args.max_tokens, args.batch_size)
            await evict(eng, ("l1", "l2", "l3"))
        before = eng.metrics()
        prof: dict = {}
        with host_profile(tier, prof) if args.profile else contextlib.nullcontext():
            t0 = time.perf_counter()
            recs = await run_batch(eng, prompts, args.max_tokens, args.batch_size)
            wall = time.perf_counter() - t0
        await eng.cache.drain()
        delta = metrics_delta(eng.metrics(), before)
        if args.trace:
            await trace_requests(eng, prompts[:4], args, Path(args.trace) / f"{tier}.json.gz")
        l1_checks = []
        for i, (rec, ref) in enumerate(zip(recs, reference or [])):
            if rec["error"] is None and rec["ids"] != ref and len(l1_checks) < 10:
                await timed(eng, prompts[i], args.max_tokens)  # its prefix is now in L1
                again = await timed(eng, prompts[i], args.max_tokens)
                l1_checks.append({"request": i, "output": rec["ids"], "recompute": ref, "l1_hit": again["ids"],
                                  "equals_l1_hit": again["ids"] == rec["ids"]})
        integrity = integrity_of(eng)
        status = eng.status()
        tiers = {t: s["capacity_pages"] for t, s in status["tiers"].items() if s}
        learned = status["cost_model"]  # what the cost policy decided with, at the end of the run
        bpt = eng.cache.geometry.bytes_per_token
    finally:
        await close_engine(eng)
    del eng
    free_memory()
    ok = [r for r in recs if r["error"] is None]
    dirs = directions_summary(delta)
    return {
        "tier": tier, "policy": args.policy if tier in ("l2", "l2small", "l3") else None,
        "num_pages": num_pages, "host_ratio": host_ratio if tier in ("l2", "l2small", "l3") else None,
        "capacity_pages": tiers, "requests": len(recs), "completed": len(ok), "wall_s": wall,
        "req_s": len(ok) / wall if wall > 0 else None,
        "latency_ms": ms_summary([r["end"] - r["start"] for r in ok], quantiles=(50, 95, 99)),
        "hit_tokens": {t: int(v) for t, v in delta["hit_tokens"].items()},
        "recomputed_tokens": int(delta["recomputed_tokens"]),
        "tokens_read_from_l3": dirs["s2h"]["bytes"] // bpt,  # L3 hits admitted after a prefetch count as L2
        "bytes": {d: dirs[d]["bytes"] for d in dirs}, "gib_s": {d: dirs[d]["gib_s"] for d in dirs},
        "restores_done": int(delta["restores_done"]), "backups_done": int(delta["backups_done"]),
        "fallbacks": int(delta["fallbacks"]), "failures": dict(delta.get("failures", {})),
        "differs_from_recompute": l1_checks,
        "policy_skips": {k: int(v) for k, v in delta["policy_skips"].items()}, "cost_model": learned,
        "integrity": integrity, "errors": [r["error"] for r in recs if r["error"]][:5],
        "_outputs": [r["ids"] for r in recs], **prof,
    }


def hit_bound(args, base: dict, loaded: dict) -> dict:
    """What no tier can beat on this workload, from this run's own numbers: each prefix's first use
    recomputes in every tier (cold), and every later request still runs one forward over its
    uncached tail, which reads every weight once. The ceiling assumes zero host time and that
    forward at the weight-read floor (weight bytes / device read bandwidth, measured here);
    `hit_ms_for_2x` is what each hit request may cost for 2x the baseline. None for `--batch-size` > 1: requests
    in flight together share a forward's weight reads, and the wall time is no sum of the requests' times."""
    if args.batch_size > 1:
        return None
    cold = min(args.num_prefixes, args.requests)
    hits = args.requests - cold
    wall_ms = base["wall_s"] * 1e3
    cold_ms = cold * wall_ms / base["requests"]  # the baseline's mean request
    model = next(iter(loaded.values()))[0]
    weight_bytes = forward_read_bytes(model)
    read_gib_s = device_read_gib_s(args.device)
    floor_ms = weight_bytes / (read_gib_s * (1 << 30)) * 1e3 if read_gib_s else None
    need_ms = (wall_ms / 2 - cold_ms) / hits if hits else None
    return {"cold_requests": cold, "hit_requests": hits, "weight_read_floor_ms": floor_ms,
            "ceiling_vs_baseline": wall_ms / (cold_ms + hits * floor_ms) if floor_ms else None,
            "hit_ms_for_2x": need_ms, "hit_ms_for_2x_vs_floor": need_ms / floor_ms if floor_ms and need_ms else None}


async def trace_requests(eng, prompts, args, path: Path) -> None:
    """A chrome trace (CPU ops, CUDA runtime calls, kernels and copies) of a few more requests of the
    workload, one at a time: where a request's wall time goes between host and device."""
    from torch.profiler import ProfilerActivity, profile

    path.parent.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts, with_stack=True) as prof:
        for p in prompts:
            await timed(eng, p, args.max_tokens)
    prof.export_chrome_trace(str(path))  # torch gzips a path ending in .gz
    note(f"trace of {len(prompts)} requests: {path}")


def decode_pass(recs: list[dict], wall: float) -> dict:
    """Decode window of one pass: from the last first token to the last finish. Its steps, from
    the token times of the request that started last (every request of the batch gets one token a
    step): median, p90 and max ms, and the steps over 1.25 x the median with what they took beyond
    it (`slow_excess_ms`: did the pass lose its time in every step or in a few, and which); and
    the requests' first-token times (p50, max)."""
    ok = [r for r in recs if r["error"] is None and r["first"] is not None]
    if not ok:
        return {"decode_tok_s": None, "total_tok_s": None, "window_s": 0.0, "pending_backups": None}
    last = max(ok, key=lambda r: r["first"])
    window = max(r["end"] for r in ok) - last["first"]
    tokens = sum(len(r["ids"]) - 1 for r in ok)
    steps_ms = [(b - a) * 1e3 for a, b in zip(last["times"], last["times"][1:])]
    step_p50 = median(steps_ms) if steps_ms else None
    slow = [(i, round(ms, 2)) for i, ms in enumerate(steps_ms) if step_p50 and ms > 1.25 * step_p50]
    ttft_ms = sorted((r["first"] - r["start"]) * 1e3 for r in ok)
    return {"decode_tok_s": tokens / window if window > 0 else None, "window_s": window,
            "ttft_ms": {"p50": median(ttft_ms), "max": ttft_ms[-1]},
            "total_tok_s": sum(len(r["ids"]) for r in ok) / wall if wall > 0 else None,
            "pending_backups": last["pending_backups"], "decode_tokens": tokens, "completed": len(ok),
            "step_ms": {"p50": step_p50, "p90": percentile(steps_ms, 90),
                        "max": max(steps_ms) if steps_ms else None,
                        "slow_excess_ms": sum(ms - step_p50 for _, ms in slow), "slow_steps": slow[:12]}}


async def decode_run(args, tier: str, vocab: int, bdir: BenchDir) -> dict:
    """One engine: a warm-up pass, then `--decode-repeats` passes of distinct prompts (all tiers
    emptied before each, so every pass backs its prefills up again); median decode tokens/s."""
    from scheduler.engine import Engine

    ps, n = page_size_of(args), args.decode_batch
    per_req = -(-(args.prefix_tokens + 1 + args.decode_tokens) // ps)
    num_pages = args.num_pages or n * per_req + 16
    cfg = engine_config(args, tier, num_pages, args.host_ratio or 1.0, bdir.l3_path(f"decode-{tier}"))
    # L3 = L2: holds every prompt. policy "always": every prefill is backed up (the traffic under
    # test), whatever the cost policy's reuse admission would conclude from this write-only pattern
    eng = Engine(cfg.with_hicache(storage_ratio=1.0 if tier == "l3" else 0.0, policy=args.decode_policy))

    def prompts(salt):
        rng = random.Random(args.seed * 104729 + salt)
        return [[rng.randrange(vocab) for _ in range(args.prefix_tokens + 1)] for _ in range(n)]
    passes, outputs, errors = [], [], []
    try:
        await eng.start()
        await run_batch(eng, prompts(1), args.decode_tokens, n)  # warm-up: same shapes, other prompts
        await evict(eng, ("l1", "l2", "l3"))
        before = eng.metrics()
        for rep in range(args.decode_repeats):
            t0 = time.perf_counter()
            recs = await run_batch(eng, prompts(2 + rep), args.decode_tokens, n)
            passes.append(decode_pass(recs, time.perf_counter() - t0))
            outputs.append([r["ids"] for r in recs])
            errors += [r["error"] for r in recs if r["error"]]
            await evict(eng, ("l1", "l2", "l3"))
        delta = metrics_delta(eng.metrics(), before)
        integrity = integrity_of(eng)
    finally:
        await close_engine(eng)
    del eng
    free_memory()
    med = lambda key: median([p[key] for p in passes if p[key] is not None])  # noqa: E731
    return {"tier": tier, "policy": args.decode_policy if tier != "none" else None, "num_pages": num_pages,
            "repeats": args.decode_repeats,
            "decode_tok_s": med("decode_tok_s"), "total_tok_s": med("total_tok_s"),
            "decode_tok_s_passes": [p["decode_tok_s"] for p in passes],
            "step_ms_passes": [p.get("step_ms") for p in passes],
            "ttft_ms_passes": [p.get("ttft_ms") for p in passes],
            "completed": sum(p.get("completed", 0) for p in passes),
            "bytes": {d: s["bytes"] for d, s in directions_summary(delta).items()},
            "backups_done": int(delta["backups_done"]),
            "backups_pending_at_decode_start": max((p["pending_backups"] or 0) for p in passes) if passes else None,
            "integrity": integrity, "errors": errors[:5], "_outputs": outputs}


async def amain(args) -> dict:
    from scheduler.presets import model_config_of

    vocab = model_config_of(args.model).vocab_size
    out: dict = {"model": args.model, "device": args.device, "policy": args.policy,
                 "workload": {k: getattr(args, k) for k in ("num_prefixes", "prefix_tokens", "requests", "batch_size",
                                                             "max_tokens", "warmup", "page_size")}}
    out["workload"]["page_size"] = page_size_of(args)
    bdir = BenchDir(args.storage_path)
    try:
        with shared_model() as loaded:
            if not args.decode_only:
                prompts = rotating_prompts(args, vocab, 1, args.requests)
                warm = rotating_prompts(args, vocab, 2, args.warmup) if args.warmup else []
                runs = []
                base_tier = "none" if "none" in args.tier_list else "reference"
                order = [base_tier] + [t for t in args.tier_list if t != "none"]
                for tier in order:
                    note(f"throughput: tier {tier} ...")
                    runs.append(await throughput(args, tier, prompts, warm, bdir,
                                                 runs[0]["_outputs"] if runs else None))
                base = runs[0]
                for r in runs:
                    # a request may differ from recompute only where it equals its own L1-hit output
                    r["outputs_match"] = (not r["errors"] and all(c["equals_l1_hit"] for c in r["differs_from_recompute"])
                                          and sum(a != b for a, b in zip(r["_outputs"], base["_outputs"]))
                                          == len(r["differs_from_recompute"]))
                    r["mismatched_requests"] = [i for i, (a, b) in enumerate(zip(r["_outputs"], base["_outputs"]))
                                                if a != b][:20]
                    r["speedup_vs_none"] = (r["req_s"] / base["req_s"]) if base["req_s"] and r["req_s"] else None
                out["baseline"] = base["tier"]
                if base["tier"] == "none":
                    out["bound"] = hit_bound(args, base, loaded)
                out["tiers"] = [r for r in runs if r["tier"] != "reference"]
                if base["tier"] == "reference":
                    out["reference"] = {k: base[k] for k in ("req_s", "integrity", "errors")}
                out["outputs_match"] = all(r["outputs_match"] for r in runs)
                out["integrity"] = next((f"{r['tier']}: {r['integrity']}" for r in runs
                                         if r["integrity"] != "passed"), "passed")
            if args.decode_batch:
                note(f"decode: batch {args.decode_batch} x {args.decode_tokens} tokens, hicache on "
                     f"({args.decode_tier}) and off ...")
                on = await decode_run(args, args.decode_tier, vocab, bdir)
                off = await decode_run(args, "none", vocab, bdir)
                match = on["_outputs"] == off["_outputs"] and not on["errors"] and not off["errors"]
                out["decode"] = {"batch": args.decode_batch, "tokens": args.decode_tokens,
                                 "prompt_tokens": args.prefix_tokens + 1, "hicache_on": on, "hicache_off": off,
                                 "ratio_on_off": (on["decode_tok_s"] / off["decode_tok_s"])
                                 if on["decode_tok_s"] and off["decode_tok_s"] else None,
                                 # the whole pass, prefills and first tokens included: most backups
                                 # have ended before the decode window opens
                                 "total_ratio_on_off": (on["total_tok_s"] / off["total_tok_s"])
                                 if on["total_tok_s"] and off["total_tok_s"] else None,
                                 "outputs_match": match}
                out["outputs_match"] = out.get("outputs_match", True) and match
                bad = next((f"decode {r['tier']}: {r['integrity']}" for r in (on, off) if r["integrity"] != "passed"),
                           None)
                out["integrity"] = bad if bad and out.get("integrity", "passed") == "passed" else \
                    out.get("integrity", "passed")
    finally:
        bdir.close()
    for r in out.get("tiers", []) + ([out["decode"]["hicache_on"], out["decode"]["hicache_off"]]
                                     if "decode" in out else []):
        r.pop("_outputs", None)
    return out


def human(out: dict) -> str:
    parts = []
    if "tiers" in out:
        rows = [[r["tier"], r["policy"] or "-", fmt(r["req_s"]), fmt(r["speedup_vs_none"]),
                 fmt(r["latency_ms"]["p50"]), fmt(r["latency_ms"]["p95"]), fmt(r["latency_ms"]["p99"]),
                 "/".join(str(r["hit_tokens"][t]) for t in ("l1", "l2", "l3")), str(r["recomputed_tokens"]),
                 "/".join(fmt_bytes(r["bytes"][d]) for d in ("d2h", "h2d", "h2s", "s2h")),
                 fmt(r["outputs_match"]), "ok" if r["integrity"] == "passed" else "FAIL"] for r in out["tiers"]]
        parts.append(table(["tier", "policy", "req/s", f"x {out['baseline']}", "p50 ms", "p95 ms", "p99 ms",
                            "hit l1/l2/l3", "recomputed", "moved d2h/h2d/h2s/s2h", "match", "integrity"], rows))
    if out.get("bound"):
        b = out["bound"]
        parts.append(f"bound: {b['cold_requests']} cold requests recompute in every tier; 2x {out['baseline']} "
                     f"needs each of the {b['hit_requests']} others <= {fmt(b['hit_ms_for_2x'])} ms"
                     + (f" ({fmt(b['hit_ms_for_2x_vs_floor'])} x the {fmt(b['weight_read_floor_ms'])} ms weight-read "
                        f"floor of its one forward); ceiling with zero host time {fmt(b['ceiling_vs_baseline'])}x"
                        if b["weight_read_floor_ms"] else ""))
    if "decode" in out:
        d = out["decode"]
        rows = [[name, r["tier"], fmt(r["decode_tok_s"], "{:.1f}"), fmt(r["total_tok_s"], "{:.1f}"),
                 fmt_bytes(r["bytes"]["d2h"]), str(r["backups_pending_at_decode_start"]), str(r["backups_done"]),
                 "ok" if r["integrity"] == "passed" else "FAIL"]
                for name, r in (("hicache on", d["hicache_on"]), ("hicache off", d["hicache_off"]))]
        headers = ["decode", "tier", "decode tok/s", "total tok/s", "d2h", "pending@decode", "backups", "integrity"]
        parts.append(table(headers, rows)
                     + f"\ndecode tok/s on/off: {fmt(d['ratio_on_off'], '{:.3f}')}  whole pass on/off: "
                       f"{fmt(d['total_ratio_on_off'], '{:.3f}')}  outputs match: "
                       f"{fmt(d['outputs_match'])}")
        for name, r in (("on", d["hicache_on"]), ("off", d["hicache_off"])):
            steps = [s for s in r.get("step_ms_passes", []) if s]
            parts.append(f"decode steps ({name}), per pass: " + "; ".join(
                f"p50 {fmt(s['p50'])} / p90 {fmt(s['p90'])} / max {fmt(s['max'])} ms, slow {fmt(s['slow_excess_ms'])} ms "
                f"{s['slow_steps'][:6]}"
                for s in steps))
            parts.append(f"first token ({name}), per pass: " + "; ".join(
                f"p50 {fmt(t['p50'])} / max {fmt(t['max'])} ms" for t in r.get("ttft_ms_passes", []) if t))
    return "\n\n".join(parts)


def main(argv=None) -> int:
    import uvloop

    args = parse_args(argv)
    out = uvloop.run(amain(args))
    emit(out, args.json, args.out, human(out))
    return 0 if out.get("outputs_match") and out.get("integrity") == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())

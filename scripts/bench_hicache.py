"""Forced-tier restore latency: how long does a request take when its prefix comes back from L2 / L3,
against recompute and against the physical floor measured in the same run?

Two different seeded random prefixes alternate (A, B, A, B, ...). Each request is the prefix plus one
new token, greedy, max_tokens 1, so latency (submit -> finish) equals TTFT. `--num-pages` (L1) is
auto-sized so two prefixes overflow L1, and before every measured request the tiers above the forced
one are emptied explicitly (L1; L1 and L2 for `--tier l3`), so the hit really comes from that tier.
`--tier none` runs with hicache disabled: every measured request recomputes its prefix.

Checks: the outputs of every request equal the recompute outputs token for token (reference
outputs come from the SAME engine with all tiers emptied before each reference request), and
`engine.check_integrity()` passes between phases.

Same-run limits (same process, same byte count = restored tokens x bytes per token):
  - a plain pinned H2D / D2H `copy_` on CUDA (a CPU memcpy on the CPU), median of 5;
  - a raw sequential read of the same bytes from a file next to the L3 file, same cache state (cold:
    dropped from the page cache before each read), `--io-workers` threads of os.preadv into a pinned
    buffer (l3 only);
  - the forward over the uncached tail: the same request with its whole prefix already in L1.
Floors: L2 = bytes / H2D + tail forward; L3 = bytes / file read + bytes / H2D + tail forward.

Examples:
    python scripts/bench_hicache.py --model tiny --device cpu --tier l2 --prefix-tokens 64
    python scripts/bench_hicache.py --tier l2 --policy always --prefix-tokens 350,1000,2000,3500,8000 \\
        --compare-recompute --json --out out/l2.json
    python scripts/bench_hicache.py --tier l3 --storage-cache cold --prefix-tokens 3500 --page-size 1
    python scripts/bench_hicache.py --tier none --prefix-tokens 3500

With `--json`, stdout carries only JSON (one object, or a list for a sweep) and the human table goes
to stderr. Exit status 1 when an output differs from recompute or the integrity check fails.
A prefix that is not a multiple of the page size leaves `prefix % page_size + 1` tokens to compute
after the restore (`tail_tokens`); the tail-forward limit measures that same tail.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cli import (STORAGE_PATH_HELP, check_device, check_engine_config, check_storage_path,  # noqa: E402
                       non_negative_int, positive_float, positive_int)
from bench_common import (CPU_SMOKE, GIB, BenchDir, add_common_args, add_engine_mode_args, close_engine,  # noqa: E402
                          copy_limits, parse_common_args, hicache_override_args, engine_mode_args, directions_summary, emit, evict, file_read_limit, fmt, free_memory, integrity_of,
                          median, metrics_delta, ms_summary, note, run_one, shared_model, table, tail_forward_s)

ABOVE = {"none": ("l1",), "l2": ("l1",), "l3": ("l1", "l2")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, model=CPU_SMOKE, device=("cuda", "cpu"), page_size=0, seed=0)
    p.add_argument("--tier", default="l2", choices=["none", "l2", "l3"])
    p.add_argument("--policy", default="always", choices=["always", "cost"])
    p.add_argument("--prefix-tokens", default="3500", help="one length or a comma list to sweep")
    p.add_argument("--num-pages", type=int, default=0, help="L1 pages (default: 1.5 x one request)")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--warmup-alternations", type=non_negative_int, default=2)
    p.add_argument("--storage-cache", default="cold", choices=["cold", "warm"])
    p.add_argument("--storage-path", default=None, help=STORAGE_PATH_HELP)
    p.add_argument("--host-ratio", type=positive_float, default=2.0, help="L2 pages = ratio x L1 pages")
    p.add_argument("--storage-ratio", type=float, default=1.0, help="L3 pages = ratio x L2 pages (l3)")
    p.add_argument("--io-workers", type=positive_int, default=4, help="L3 I/O threads (also the raw read's)")
    p.add_argument("--disable-checksum", action="store_true", help="no per-page L3 checksums")
    p.add_argument("--disable-prefetch", action="store_true", help="blocking restores")
    p.add_argument("--transfer-backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--max-prefill-tokens", type=non_negative_int, default=0,
                   help="default: the whole prompt in one batch")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="after the measured requests, 2 more under torch.profiler: DIR/<tier>_<tokens>.json.gz "
                        "(scripts/trace_copies.py reads its copies). The profiler's hooks stay in the process and "
                        "slow its CUDA calls (a graph replay's host time 3-9x, session 26): later lengths' "
                        "figures are for reading the trace, not for the record")
    p.add_argument("--compare-recompute", action="store_true", help="also measure --tier none in this run")
    add_engine_mode_args(p)
    args = parse_common_args(p, argv)
    try:
        args.lengths = [int(x) for x in str(args.prefix_tokens).split(",") if x.strip()]
    except ValueError:  # (regression: int()'s traceback)
        p.error(f"--prefix-tokens takes integers (a comma list), got {args.prefix_tokens!r}")
    if not args.lengths or min(args.lengths) < 1 or args.iterations < 1 or args.num_pages < 0:
        p.error("--prefix-tokens must be positive, --iterations >= 1 and --num-pages >= 0")
    if args.tier == "l3" and args.storage_ratio <= 0:  # (regression: None.drop_page_cache, a traceback)
        p.error("--tier l3 needs an L3: --storage-ratio > 0")
    check_device(p, args.device)
    check_storage_path(p, args.storage_path)  # (regression: a directory ended in IsADirectoryError at exit)
    if args.trace is not None and os.path.exists(args.trace) and not os.path.isdir(args.trace):
        p.error(f"--trace {args.trace}: exists and is not a directory")
    if args.log_json is not None and (os.path.isdir(args.log_json)
                                      or not os.path.isdir(os.path.dirname(os.path.abspath(args.log_json)))):
        p.error(f"--log-json {args.log_json}: a file in an existing directory, not a directory")
    for n in args.lengths:  # what the engine refuses (--page-size, ratios ...), before any model loads
        for tier in {args.tier, "none"} if args.compare_recompute else {args.tier}:
            check_engine_config(p, lambda: build_config(args, tier, n, args.storage_path or "l3.kv"))
    return args


def make_prompts(prefix_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """Two different seeded random prefixes, each followed by one new token."""
    out = []
    for k in range(2):
        rng = random.Random(seed * 1000 + prefix_tokens * 2 + k)
        out.append([rng.randrange(vocab) for _ in range(prefix_tokens + 1)])
    return out


def build_config(args, tier: str, prefix_tokens: int, storage_path: str | None):
    from scheduler.config import EngineConfig

    ps = args.page_size or (16 if args.device == "cuda" else 4)
    need = -(-(prefix_tokens + 2) // ps)  # pages of one request: prompt + 1 output token
    num_pages = args.num_pages or need + max(2, need // 2)
    cfg = EngineConfig(model=args.model, device=args.device, seed=args.seed, page_size=ps, num_pages=num_pages,
                       max_prefill_tokens=args.max_prefill_tokens or max(2048, prefix_tokens + 1),
                       cuda_graphs=not args.disable_cuda_graphs, log_json=args.log_json,
                       restore_overlap=not args.disable_restore_overlap, **engine_mode_args(args))
    return cfg.with_hicache(
        enable=tier != "none", policy=args.policy, host_ratio=args.host_ratio,
        storage_ratio=args.storage_ratio if tier == "l3" else 0.0,
        storage_path=storage_path if tier == "l3" else None, io_workers=args.io_workers,
        storage_checksum=not args.disable_checksum, transfer_backend=args.transfer_backend,
        prefetch=not args.disable_prefetch, **hicache_override_args(args))


async def trace_forced(forced, args, path: Path) -> None:
    """A chrome trace (CPU ops, CUDA runtime calls, kernels and copies) of two more forced-tier
    requests, outside the measured ones: where a restore's copies and its forward meet."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    path.parent.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for i in range(2):
            await forced(args.iterations + i)
    prof.export_chrome_trace(str(path))  # torch gzips a path ending in .gz
    note(f"trace of 2 requests: {path}")


def dense_gap(eng, prompt: list[int], a: int, b: int) -> dict:
    """First-token logits of tokens a and b from a plain dense forward of the whole prompt (the
    model's own dtype), and the spread of all logits: a gap far below the spread is a near-tie that
    a different summation order (a full prefill against a short tail over cached KV) may flip."""
    import torch

    with torch.inference_mode():
        logits = eng.model.forward_dense(torch.tensor(prompt, device=eng.device), last_only=True)[0].float()
    return {"recompute": a, "l1_hit": b, "logit_recompute": logits[a].item(), "logit_l1_hit": logits[b].item(),
            "gap": (logits[a] - logits[b]).item(), "logit_std": logits.std().item()}


def source_of(delta: dict, cached: dict, reusable: int) -> str:
    """Where one request's prefix came from, from its own metrics delta (an L3 restore that went
    through a queue-time prefetch is admitted as an L2 hit; its S2H bytes still show)."""
    d = delta["directions"]
    if d["s2h"]["bytes"] > 0:
        return "l3"
    if d["h2d"]["bytes"] > 0:
        return "l2"
    if reusable and cached.get("l1", 0) >= reusable:
        return "l1"
    return "recompute"


async def measure(args, tier: str, prefix_tokens: int, prompts, bdir: BenchDir) -> dict:
    from scheduler.engine import Engine

    cfg = build_config(args, tier, prefix_tokens, bdir.l3_path(f"{prefix_tokens}"))
    eng = Engine(cfg)
    ps, bpt = eng.page_size, eng.cache.geometry.bytes_per_token
    reusable = prefix_tokens - prefix_tokens % ps
    notes, integrity = [], "passed"

    def check(phase: str) -> None:
        nonlocal integrity
        r = integrity_of(eng)
        if r != "passed" and integrity == "passed":
            integrity = f"{phase}: {r}"

    if 2 * reusable // ps <= eng.cache.l1.num_pages:
        notes.append("L1 holds both prefixes (--num-pages); explicit eviction still forces the tier")
    outputs_ok, l1_ok, mismatches, errors, mismatch_details, near_ties = True, True, 0, [], [], []
    try:
        await eng.start()
        # reference: every tier emptied before each request -> pure recompute on this engine
        # and the same prompt again right after, its prefix an L1 hit: the output of the tail forward
        # over bit-identical KV, which a restore must reproduce exactly (recompute may differ in bf16)
        refs, refs_l1, ref_lat, refs_l1_cached = [], [], [], []
        for p in prompts:
            await evict(eng, ("l1", "l2", "l3"))
            ids, lat, _, err = await run_one(eng, p)
            refs.append(ids)
            ref_lat.append(lat)
            ids, _, l1_cached, err2 = await run_one(eng, p)
            refs_l1.append(ids)
            refs_l1_cached.append(l1_cached)
            errors += [e for e in (err, err2) if e]
        check("reference")
        for i, p in enumerate(prompts):  # a full prefill and a tail forward disagree: how close a call was it
            if refs[i] and refs_l1[i] and refs[i][0] != refs_l1[i][0]:
                near_ties.append(dense_gap(eng, p, refs[i][0], refs_l1[i][0]) | {"prompt": i})
        cold = tier == "l3" and args.storage_cache == "cold"
        dropped = None

        async def forced(i: int):
            nonlocal dropped, outputs_ok, l1_ok, mismatches
            await evict(eng, ABOVE[tier])
            if cold:
                ok = eng.cache.store.drop_page_cache()
                if dropped is None and not ok:
                    note("the OS did not allow dropping the L3 file from the page cache: reads may be warm")
                dropped = ok if dropped is None else dropped and ok
            m0 = eng.metrics()
            ids, lat, cached, err = await run_one(eng, prompts[i % 2])
            d = metrics_delta(eng.metrics(), m0)
            src = source_of(d, cached, reusable)
            # a restore reproduces the L1-hit output (same KV, same tail kernels); a request that
            # recomputed (a warm-up whose prefix the reference runs evicted) reproduces the recompute
            same_path = refs[i % 2] if src == "recompute" else refs_l1[i % 2]
            outputs_ok &= ids == refs[i % 2] and err is None
            l1_ok &= ids == same_path and err is None
            mismatches += ids != refs[i % 2]
            errors.extend([err] if err else [])
            if ids != same_path and len(mismatch_details) < 6:
                mismatch_details.append({"iteration": i, "prompt": i % 2, "source": src, "cached": cached,
                                         "output": ids, "recompute": refs[i % 2], "l1_hit": refs_l1[i % 2],
                                         "l1_hit_cached": refs_l1_cached[i % 2]})
            return lat, src, int(d["directions"]["h2d"]["bytes"]) // bpt

        for i in range(2 * args.warmup_alternations):
            await forced(i)
        check("warmup")
        before = eng.metrics()
        lats, sources, by_source = [], [], {"l1": 0, "l2": 0, "l3": 0}
        for i in range(args.iterations):
            lat, src, restored = await forced(i)
            lats.append(lat)
            sources.append(src)
            if src in ("l2", "l3"):
                by_source[src] += restored
            elif src == "l1":
                by_source["l1"] += reusable
        await eng.cache.drain()
        delta = metrics_delta(eng.metrics(), before)
        check("measured")
        if args.trace:
            await trace_forced(forced, args, Path(args.trace) / f"{tier}_{prefix_tokens}.json.gz")
        # tail forward: the same request with its whole prefix already resident in L1
        last = prompts[(args.iterations - 1) % 2]
        tail = []
        for _ in range(max(3, min(args.iterations, 8))):
            ids, lat, cached, err = await run_one(eng, last)
            outputs_ok &= ids == refs[(args.iterations - 1) % 2] and err is None
            l1_ok &= ids == refs_l1[(args.iterations - 1) % 2] and err is None
            tail.append(lat)
            if reusable and cached.get("l1", 0) < reusable and not any("tail-forward" in n for n in notes):
                notes.append(f"tail-forward request hit only {cached.get('l1', 0)} L1 tokens of {reusable}")
        check("tail")
        # the floor's forward: the same tail's forward alone (the request above adds its scheduling,
        # matching and completion, ~1.2-1.5 ms of host time that a floor must not hold; session 20)
        tail_tokens = len(last) - reusable
        forward = (await tail_forward_s(eng, last, tail_tokens, max(8, args.iterations))
                   if reusable >= tail_tokens > 0 else tail)
        cost_state = eng.cache.cost.state()["directions"]
        # (CUDA: the copy kernel's restore timed against the DMAs' at start, and the bound that chose)
        calibration = eng.cache.kernel_calibration and dataclasses.asdict(eng.cache.kernel_calibration)
        store_dir = Path(eng.cache.store.path).parent if eng.cache.store is not None else Path(bdir.dir)
    finally:
        await close_engine(eng)
    del eng
    free_memory()
    if errors:
        notes.append(f"request errors: {errors[:3]}")
    if by_source["l3"] and delta["hit_tokens"]["l3"] < by_source["l3"]:
        notes.append("L3 restores went through the queue-time prefetch (S2H), then an L2 restore (H2D): the "
                     "engine counts those hits as L2 and its restore_ms covers only the H2D step; see "
                     "hit_tokens_by_source and transfer_ms")
    if not outputs_ok and l1_ok:
        notes.append("outputs differ from recompute but equal the L1-hit run of the same prompt: the restored "
                     "KV is exact; the tail forward's kernels round differently from a full prefill")
    if dropped is False:
        notes.append("page cache drop not allowed: 'cold' L3 reads may have been warm")

    restore_bytes = reusable * bpt
    limits = {"h2d_gib_s": None, "d2h_gib_s": None, "file_read_gib_s": None,
              "tail_forward_ms": median(forward) * 1e3, "tail_request_ms": median(tail) * 1e3,
              "restore_bytes": restore_bytes}
    if tier != "none" and restore_bytes:
        cl = copy_limits(restore_bytes, args.device)
        limits.update(h2d_gib_s=cl["h2d_gib_s"], d2h_gib_s=cl["d2h_gib_s"], copy_kind=cl["copy_kind"])
    if tier == "l3" and restore_bytes:
        fr = file_read_limit(str(store_dir), restore_bytes, args.io_workers, cold=args.storage_cache == "cold",
                             pinned=args.device == "cuda")
        limits.update(file_read_gib_s=fr["file_read_gib_s"], file_read_llc_cold_gib_s=fr["file_read_llc_cold_gib_s"],
                      file_read_cache=fr["cache"],
                      file_read_threads=fr["threads"], page_cache_dropped=fr["page_cache_dropped"])

    lat_ms = ms_summary(lats, quantiles=(50,))
    floor_s = None
    if tier != "none" and restore_bytes:
        floor_s = restore_bytes / GIB / limits["h2d_gib_s"] + limits["tail_forward_ms"] / 1e3
        if tier == "l3":
            floor_s += restore_bytes / GIB / limits["file_read_gib_s"]
    dirs = directions_summary(delta)
    s2h = dirs["s2h"]
    return {
        "tier": tier, "policy": args.policy if tier != "none" else None, "model": args.model,
        "device": args.device, "prefix_tokens": prefix_tokens, "reusable_tokens": reusable,
        "tail_tokens": prefix_tokens - reusable + 1, "page_size": ps, "num_pages": cfg.num_pages,
        "bytes_per_token": bpt, "iterations": args.iterations, "warmup_alternations": args.warmup_alternations,
        "storage_cache": args.storage_cache if tier == "l3" else None,
        "storage_checksum": not args.disable_checksum if tier == "l3" else None,
        "outputs_match": bool(outputs_ok), "outputs_match_l1_hit": bool(l1_ok),
        "mismatches_vs_recompute": int(mismatches), "mismatch_details": mismatch_details,
        "recompute_vs_l1_hit": near_ties, "integrity": integrity,
        "latency_ms": lat_ms, "latencies_ms": [x * 1e3 for x in lats],
        "reference_recompute_ms": min(ref_lat) * 1e3,  # the faster of the two reference requests
        "restore_ms": (delta["restore_s"] / delta["restores_done"] * 1e3) if delta["restores_done"] else None,
        "transfer_ms": {d: (dirs[d]["recurring_s"] / dirs[d]["count"] * 1e3) if dirs[d]["count"] else None
                        for d in ("s2h", "h2d")},
        "hit_tokens": {t: int(v) for t, v in delta["hit_tokens"].items()},
        "hit_tokens_by_source": by_source,
        "recomputed_tokens": int(delta["recomputed_tokens"]),
        "gib_s": {d: dirs[d]["gib_s"] for d in dirs},
        "transfers": dirs,
        "l3_extents": (s2h["extents"] / s2h["count"]) if s2h["count"] else None,
        "limits": limits,
        "kernel_calibration": calibration,
        "floor_ms": floor_s * 1e3 if floor_s else None,
        "ratio_to_floor": (lat_ms["p50"] / (floor_s * 1e3)) if floor_s else None,
        "decisions": {"sources": {s: sources.count(s) for s in ("l1", "l2", "l3", "recompute")},
                      "restores_done": int(delta["restores_done"]), "fallbacks": int(delta["fallbacks"]),
                      "policy_skips": {k: int(v) for k, v in delta["policy_skips"].items()}},
        "cost_model": {"recompute_us_per_token": cost_state["recompute"]["us_per_token"],
                       **{f"{d}_gib_s": cost_state[d]["gib_s"] for d in ("h2d", "s2h")}},
        "notes": notes,
        "_refs": refs,
    }


async def amain(args) -> list[dict]:
    from scheduler.presets import model_config_of

    vocab = model_config_of(args.model).vocab_size
    results = []
    bdir = BenchDir(args.storage_path)
    try:
        with shared_model():
            for n in args.lengths:
                prompts = make_prompts(n, vocab, args.seed)
                note(f"prefix {n}: tier {args.tier}" + (f" ({args.policy})" if args.tier != "none" else "") + " ...")
                r = await measure(args, args.tier, n, prompts, bdir)
                if args.compare_recompute and args.tier != "none":
                    note(f"prefix {n}: tier none (recompute) ...")
                    base = await measure(args, "none", n, prompts, bdir)
                    r["recompute"] = {k: base[k] for k in ("latency_ms", "outputs_match", "integrity",
                                                           "limits")}
                    r["speedup_vs_recompute"] = base["latency_ms"]["p50"] / r["latency_ms"]["p50"]
                    same = base["_refs"] == r["_refs"]
                    r["outputs_match"] = r["outputs_match"] and base["outputs_match"] and same
                    if not same:
                        r["notes"].append("reference outputs differ between the hicache and recompute engines")
                    if base["integrity"] != "passed" and r["integrity"] == "passed":
                        r["integrity"] = f"recompute engine: {base['integrity']}"
                r.pop("_refs")
                results.append(r)
    finally:
        bdir.close()
    return results


def human(results: list[dict]) -> str:
    rows = []
    for r in results:
        rows.append([str(r["prefix_tokens"]), r["tier"], r["policy"] or "-", fmt(r["latency_ms"]["p50"]),
                     fmt(r["latency_ms"]["mean"]), fmt(r["restore_ms"]), fmt(r["floor_ms"]),
                     fmt(r["ratio_to_floor"]),
                     fmt(r.get("recompute", {}).get("latency_ms", {}).get("p50")),
                     fmt(r.get("speedup_vs_recompute")), fmt(r["gib_s"]["h2d"], "{:.1f}"),
                     fmt(r["gib_s"]["s2h"], "{:.1f}"), fmt(r["limits"]["tail_forward_ms"]),
                     "/".join(str(r["decisions"]["sources"][s]) for s in ("l2", "l3", "recompute")),
                     f"{fmt(r['outputs_match'])}/{fmt(r['outputs_match_l1_hit'])}",
                     "ok" if r["integrity"] == "passed" else "FAIL"])
    return table(["prefix", "tier", "policy", "p50 ms", "mean ms", "restore ms", "floor ms", "x floor",
                  "recomp ms", "speedup", "h2d GiB/s", "s2h GiB/s", "tail ms", "l2/l3/rec",
                  "match rec/l1", "integrity"], rows)


def main(argv=None) -> int:
    import uvloop

    args = parse_args(argv)
    results = uvloop.run(amain(args))
    for r in results:
        for msg in r["notes"]:
            note(f"prefix {r['prefix_tokens']}: {msg}")
    emit(results[0] if len(results) == 1 else results, args.json, args.out, human(results))
    ok = all(r["outputs_match"] and r["outputs_match_l1_hit"] and r["integrity"] == "passed" for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

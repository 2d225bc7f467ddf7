"""Micro-benchmark of the small-forward kernels at the 8B shape (Qwen3-8B: 32 query heads, 8 KV heads,
head dim 128, hidden 4096, intermediate 12288, bf16, page 16): the paged decode/tail attention in its
variants (splits, block, warps; timed inside a CUDA graph) and the fused element-wise kernels against
the torch ops they replace. Checks each against its torch reference; prints one table.

    python scripts/bench_kernels.py --json --out out/kernels.json     # on the GPU
    python scripts/bench_kernels.py --attention --out out/attention_sweep.json  # the attention sweep only
    python scripts/bench_kernels.py --attention-batch   # decode of 8-64 sequences, verify steps: 1-16 splits
    python scripts/bench_kernels.py --skinny --skinny-rows 1,16,32,64   # projections at those rows, cuBLAS too
    python scripts/bench_kernels.py --lm-head           # the LM head's bf16 output + cast against float32 output
"""
from __future__ import annotations

import argparse
import functools
import concurrent.futures
import json
import multiprocessing
import os
import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_cli import human_output, int_list, positive_int  # noqa: E402
from bench_common import add_common_args  # noqa: E402
from kernels import fused_ops  # noqa: E402
from kernels.decode_attention import decode_attention_torch, decode_attention_triton  # noqa: E402


def time_us(fn, reps: int = 20) -> float:
    """Device time of one call: `reps` calls captured in one CUDA graph (no launch overhead, as in
    the engine's graphs), replayed 5 times; the median replay / reps."""
    return time_calls_us([fn] * reps)


def time_calls_us(calls, replays: int = 5) -> float:
    """Device time per call of a list of distinct calls (e.g. over different weights, so none is
    served from the L2 cache), captured in one CUDA graph after the first three ran as a warm-up;
    the median of `replays` replays / len(calls)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


# the 8B layer's projections: (name, N rows of the weight, K, SwiGLU folded in)
SKINNY_SHAPES = [("qkv", 6144, 4096, False), ("o_proj", 4096, 4096, False),
                 ("gate_up", 2 * 12288, 4096, True), ("down", 4096, 12288, False)]
SKINNY_CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
                  for bn in (16, 32, 64) for bk in (128, 256) for w in (4, 8) for st in (4, 5)]
# K split in 1 / 2 / 4 (float32 partials; the projections without SwiGLU), fewer stages so that
# two programs may share an SM: 16 rows only (--skinny-split)
SPLIT_CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=st, split_k=sk)
                 for bn in (32, 64) for bk in (128, 256) for st in (3, 4, 5) for sk in (1, 2, 4)]


def skinny_rows(dev, dtype, rows_list=(1, 16), configs=SKINNY_CONFIGS, shapes=None) -> list[dict]:
    """Each projection of the 8B layer at 1 and 16 rows: cuBLAS (plus the SiLU kernel after gate_up,
    as the fused layer ran before) against kernels/skinny_gemm.py per block config, over enough
    weight copies (>= 1 GiB) that every call streams its weight from HBM."""
    from kernels import skinny_gemm

    out = []
    for name, n, k, swiglu in shapes or SKINNY_SHAPES:
        wbytes = n * k * 2
        copies = max(4, -(-(1 << 30) // wbytes))
        weights = [torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for _ in range(copies)]
        for m in rows_list:
            x = torch.randn(m, k, device=dev, dtype=dtype)

            def ref(w):
                y = torch.nn.functional.linear(x, w)
                return fused_ops.silu_mul_triton(y) if swiglu else y

            want = ref(weights[0]).float()
            ref_us = time_calls_us([lambda w=w: ref(w) for w in weights])
            row = {"proj": name, "rows": m, "n": n, "k": k, "weight_mib": wbytes / 2 ** 20, "cublas_us": ref_us,
                   "cublas_gib_s": wbytes / ref_us / 1e-6 / 2 ** 30, "configs": []}
            for cfg in configs:
                if not cfg and not swiglu:  # the engine's default: K split where its consumer adds partials
                    cfg = {"split_k": skinny_gemm.split_k_for(n, k)}
                try:
                    got = skinny_gemm.linear(x, weights[0], swiglu=swiglu, **cfg).float()
                    got = got.sum(0) if got.dim() == 3 else got  # split-K partials
                    err = ((got - want).norm() / want.norm()).item()
                    us = time_calls_us([lambda w=w: skinny_gemm.linear(x, w, swiglu=swiglu, **cfg) for w in weights])
                except Exception as exc:  # a config that does not compile (shared memory) is skipped
                    row["configs"].append({**cfg, "error": repr(exc)[:200]})
                    continue
                row["configs"].append({**cfg, "us": us, "gib_s": wbytes / us / 1e-6 / 2 ** 30, "rel_err": err})
            ok = [c for c in row["configs"] if "us" in c]
            row["best"] = min(ok, key=lambda c: c["us"]) if ok else None
            out.append(row)
        del weights
        torch.cuda.empty_cache()
    return out


# (sequences, query rows per sequence, context tokens) at the 8B shape, and the decode_attention_triton
# overrides timed at each: the default run's grid, and --attention's (software pipelining included)
ATTENTION_SHAPES = [(1, 1, 350), (1, 1, 1000), (1, 1, 3500), (1, 1, 8000), (32, 1, 576), (1, 16, 350),
                    (1, 16, 1000), (1, 16, 3500), (1, 16, 8000)]
ATTENTION_CONFIGS = [dict(splits=sp, block=bl, num_warps=w)
                     for sp in (8, 16, 32, 64) for bl in (32, 64) for w in (4, 8)] + [
    dict(prefetch_pages=False), dict(prefetch_pages=True)]  # the defaults with the page prefetch off / on
SWEEP_SHAPES = [sh for sh in ATTENTION_SHAPES if sh[0] == 1]
# --attention-batch: one-row decode of many sequences, splits below the default too (the K/V of 36 layers: 38 GB
# at 64 x 4,000 keys)
BATCH_SHAPES = [(b, 1, ctx) for b in (8, 16, 32, 64) for ctx in (576, 2000, 4000)]
BATCH_CONFIGS = [dict(splits=sp, block=bl, num_warps=4) for sp in (1, 2, 4, 8, 16) for bl in (32, 64)] + [{}]
# and several sequences of several rows (verify steps of k + 1 rows rounded to 8, tails of up to 16)
MULTI_ROW_SHAPES = [(b, r, ctx) for b, r in ((2, 8), (4, 8), (8, 8), (2, 16), (4, 16)) for ctx in (1000, 3500)]
MULTI_ROW_CONFIGS = [dict(splits=sp) for sp in (4, 8, 16)] + [{}]
# num_stages 3 is Triton's default on sm_90; 4 is back in (session 22 left it out, having seen it
# compile to the same PTX as 3 offline, where a compile without the pointers' 16-byte alignment
# pipelines nothing at all: session 24)
SWEEP_CONFIGS = [dict(splits=sp, block=bl, num_warps=w, num_stages=st)
                 for sp in (8, 16, 32) for bl in (16, 32, 64) for w in (2, 4, 8) for st in (1, 2, 3, 4)]
ATT_HQ, ATT_HKV, ATT_D, ATT_PAGE = 32, 8, 128, 16
ATT_LAYERS = 36  # the 8B's layers: 1.2 GB of K/V at 8,000 keys
ATT_ERR_LIMIT = 3e-2  # bf16 rounding is ~1e-3 here; a config above this (or NaN) is wrong, never ranked


def attention_inputs(dev, dtype, seqs: int, per: int, ctx: int, layers: int = 1):
    """q, k, v ([layers, pages, page, Hkv, D]: distinct layers, so that a timing over them reads
    K/V from memory as a forward does, not from the L2 cache), page tables (shuffled pages) and row
    lengths of one attention shape."""
    pages_each = -(-(ctx + per) // ATT_PAGE)
    num_pages = seqs * pages_each + 1
    k = torch.randn(layers, num_pages, ATT_PAGE, ATT_HKV, ATT_D, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    tables = torch.randperm(num_pages - 1, device=dev)[: seqs * pages_each].view(seqs, pages_each)
    lens = torch.tensor([ctx + t + 1 for _ in range(seqs) for t in range(per)], device=dev)
    q = torch.randn(seqs * per, ATT_HQ, ATT_D, device=dev, dtype=dtype)
    return q, k, v, tables, lens


def attention_rows(dev, dtype, shapes=ATTENTION_SHAPES, configs=ATTENTION_CONFIGS) -> list[dict]:
    """Each shape x config (decode_attention_triton's overrides; {} = the engine's default) timed in a
    CUDA graph over ATT_LAYERS layers' distinct K/V (one call per layer, as in a forward: a call
    repeated on one layer's K/V read it from the L2 cache and ran 1-5 us faster from 1,000 keys,
    session 24), with its max error against the torch reference; a config that fails to compile or
    launch gets an "error" row instead."""
    d = ATT_D
    rows = []
    for seqs, per, ctx in shapes:
        q, k_all, v_all, tables, lens = attention_inputs(dev, dtype, seqs, per, ctx, ATT_LAYERS)
        k, v = k_all[0], v_all[0]
        ref = decode_attention_torch(q, k, v, tables, lens, d ** -0.5, per).float()
        kv_bytes = seqs * (ctx + per) * ATT_HKV * d * 2 * k.element_size()
        for cfg in configs:
            row = {"seqs": seqs, "rows_per_seq": per, "context": ctx, "splits": cfg.get("splits"),
                   "block": cfg.get("block"), "warps": cfg.get("num_warps"), "num_stages": cfg.get("num_stages"),
                   "prefetch_pages": cfg.get("prefetch_pages")}

            def fn(cfg=cfg, layer=0):
                return decode_attention_triton(q, k_all[layer], v_all[layer], tables, lens, d ** -0.5, per, **cfg)
            try:
                err = (fn().float() - ref).abs().max().item()
                us = time_calls_us([functools.partial(fn, layer=i) for i in range(ATT_LAYERS)])
            except Exception as exc:  # e.g. out of shared memory: skipped, not fatal
                rows.append({**row, "error": repr(exc)[:200]})
                continue
            rows.append({**row, "us": us, "max_err": err, "kv_gib_s": kv_bytes / us / 1e3 / 1.073741824})
        del q, k, v, k_all, v_all, tables, lens, ref
        torch.cuda.empty_cache()
    return rows


def _warm_attention(cfg: dict, shapes: list, dev, dtype) -> int:
    """Worker process: compile one config at every shape (the Triton specialisations differ, e.g.
    max_pages divisible by 16) into Triton's on-disk cache; returns the failures."""
    failed = 0
    for seqs, per, ctx in shapes:
        q, k, v, tables, lens = attention_inputs(dev, dtype, seqs, per, ctx)
        try:
            decode_attention_triton(q, k[0], v[0], tables, lens, ATT_D ** -0.5, per, **cfg)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except Exception:
            failed += 1
    return failed


def precompile_attention(dev, dtype, shapes, configs, jobs: int) -> None:
    """Compile the sweep's kernels in `jobs` processes first (one compile is ~1 s of CPU, and the
    sweep has ~300 distinct ones); the timing loop then loads them from Triton's cache. Best effort:
    whatever fails here is compiled (or fails) again in the loop."""
    if jobs <= 1:
        return
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            n = len(configs)
            failed = sum(pool.map(_warm_attention, configs, [list(shapes)] * n, [dev] * n, [dtype] * n))
        print(f"precompiled {len(configs)} configs x {len(shapes)} shapes in {jobs} processes "
              f"({failed} failed)", file=sys.stderr)
    except Exception as exc:  # no worker processes: the loop compiles serially
        print(f"precompile skipped: {exc!r}"[:300], file=sys.stderr)


def attention_sweep(dev, dtype, jobs: int, rows_per_seq: int | None = None, prefetch: bool = False) -> dict:
    """--attention: SWEEP_CONFIGS at SWEEP_SHAPES plus each shape's engine default (no overrides);
    only the shapes of `rows_per_seq` query rows if given; with `prefetch`, each config with the
    page prefetch off and on."""
    shapes = [sh for sh in SWEEP_SHAPES if rows_per_seq is None or sh[1] == rows_per_seq]
    configs = SWEEP_CONFIGS
    if prefetch:
        configs = [{**c, "prefetch_pages": p} for c in configs for p in (False, True)]
    configs = [{}] + configs
    precompile_attention(dev, dtype, shapes, configs, jobs)
    rows = attention_rows(dev, dtype, shapes=shapes, configs=configs)
    defaults = {}
    for r in rows:
        if r["splits"] is None:
            defaults[shape_key(r)] = {k: r[k] for k in ("us", "max_err", "kv_gib_s", "error") if k in r}
    return {"device": torch.cuda.get_device_name(), "attention_sweep": [r for r in rows if r["splits"] is not None],
            "defaults": defaults}


def shape_key(r: dict) -> str:
    return f"{r['seqs']}x{r['rows_per_seq']}x{r['context']}"


def fit_us(points) -> tuple[float, float]:
    """Least squares us = fixed + per_key * context over (context, us); per_key in us per 1,000 keys."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else 0.0
    return my - slope * mx, slope * 1e3


def attention_ok(r: dict) -> bool:
    """Timed, and within ATT_ERR_LIMIT of the reference (NaN compares False)."""
    return "us" in r and r["max_err"] <= ATT_ERR_LIMIT


def attention_table(rows: list[dict]) -> None:
    """The default run's attention rows, the fastest config of each shape marked * among those within
    ATT_ERR_LIMIT of the reference (regression: a wrong config, fastest, was marked; it is marked ! now)."""
    print("seqs x rows  ctx  splits block warps prefetch      us   KV GiB/s  max err   (best per shape marked *,"
          " a wrong one !; - = the default)")

    def cfg_cells(r: dict) -> str:
        return " ".join(f"{'-' if r[key] is None else r[key]!s:>{w}}"
                        for key, w in (("splits", 6), ("block", 5), ("warps", 5), ("prefetch_pages", 8)))
    best = {}
    for r in rows:
        if "error" in r:
            print(f"{r['seqs']:4d} x {r['rows_per_seq']:<4d} {r['context']:5d} {cfg_cells(r)}  failed: {r['error']}")
            continue
        if attention_ok(r):
            key = (r["seqs"], r["rows_per_seq"], r["context"])
            best[key] = min(best.get(key, 1e18), r["us"])
    for r in rows:
        if "error" in r:
            continue
        mark = "!" if not attention_ok(r) else "*" if r["us"] == best[(r["seqs"], r["rows_per_seq"], r["context"])] \
            else " "
        print(f"{r['seqs']:4d} x {r['rows_per_seq']:<4d} {r['context']:5d} {cfg_cells(r)} "
              f"{r['us']:8.1f} {r['kv_gib_s']:9.0f} {r['max_err']:9.2e} {mark}")


def sweep_table(res: dict, top: int = 5) -> None:
    """Per shape: the default's us, the best config and the top ones; then per rows_per_seq, the
    fixed + per-key cost fitted over the contexts for the default, the best and the best per stages.
    Only rows within ATT_ERR_LIMIT of the reference are ranked."""
    def cfg(r: dict) -> str:
        prefetch = "p" if r.get("prefetch_pages") else ""
        return f"{r['splits']:>3}/{r['block']:<2}/{r['warps']}/{r['num_stages']}{prefetch}"
    good = attention_ok
    by_shape: dict[str, list] = {}
    for r in res["attention_sweep"]:
        by_shape.setdefault(shape_key(r), []).append(r)
    best_at: dict[str, dict] = {}
    for key, rs in by_shape.items():
        ok = sorted(filter(good, rs), key=lambda r: r["us"])
        failed, wrong = sum("us" not in r for r in rs), sum("us" in r and not good(r) for r in rs)
        default = res["defaults"].get(key, {})
        line = f"{key:>10}: default {default.get('us', float('nan')):6.1f} us"
        if ok:
            best_at[key] = ok[0]
            line += (f"; best {ok[0]['us']:6.1f} us ({cfg(ok[0])} splits/block/warps/stages[p: page prefetch], "
                     f"{default.get('us', float('nan')) / ok[0]['us']:.2f}x)")
        print(line + (f"; {failed} configs failed" if failed else "") + (f"; {wrong} wrong" if wrong else ""))
        for i, r in enumerate(ok[:top]):
            print(f"    {i + 1}. {cfg(r)}  {r['us']:6.1f} us  {r['kv_gib_s']:6.0f} KV GiB/s  "
                  f"max err {r['max_err']:.1e}")
    print("fitted over the contexts: fixed us + us per 1,000 keys")
    for per in sorted({r["rows_per_seq"] for r in res["attention_sweep"]}):
        keys = [k for k in by_shape if by_shape[k][0]["rows_per_seq"] == per]
        ctx = {k: by_shape[k][0]["context"] for k in keys}
        series = {"default": [(ctx[k], res["defaults"][k]["us"]) for k in keys if "us" in res["defaults"].get(k, {})],
                  "best": [(ctx[k], best_at[k]["us"]) for k in keys if k in best_at]}
        for st in sorted({r["num_stages"] for r in res["attention_sweep"]}):
            series[f"best, stages {st}"] = [
                (ctx[k], min(r["us"] for r in by_shape[k] if r["num_stages"] == st and good(r))) for k in keys
                if any(r["num_stages"] == st and good(r) for r in by_shape[k])]
        for name, pts in series.items():
            if len(pts) >= 2:
                fixed, per_key = fit_us(pts)
                print(f"  rows {per:2d} {name:16s} {fixed:6.2f} us + {per_key:5.2f} us / 1k keys")


def fused_rows(dev, dtype) -> list[dict]:
    h, inter, hq, hkv, d = 4096, 12288, 32, 8, 128
    out = []
    for t in (1, 16, 32):
        x, r = torch.randn(t, h, device=dev, dtype=dtype), torch.randn(t, h, device=dev, dtype=dtype)
        w = torch.randn(h, device=dev, dtype=dtype)
        gu = torch.randn(t, 2 * inter, device=dev, dtype=dtype)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=dtype)
        qw, kw = torch.randn(d, device=dev, dtype=dtype), torch.randn(d, device=dev, dtype=dtype)
        ang = torch.randn(8192, d // 2, device=dev)
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
        pos = torch.randint(0, 8192, (t,), device=dev)
        slots = torch.randperm(4096, device=dev)[:t]
        kc, vc = (torch.zeros(256, 16, hkv, d, device=dev, dtype=dtype) for _ in range(2))
        cases = {
            "add_rms_norm": (lambda: fused_ops.add_rms_norm_triton(x, r, w, 1e-6),
                             lambda: fused_ops.add_rms_norm_torch(x, r, w, 1e-6)),
            "qk_norm_rope_kv": (lambda: fused_ops.qk_norm_rope_kv_triton(qkv, qw, kw, 1e-6, cos, sin, pos, kc, vc,
                                                                         slots, hq, hkv),
                                lambda: fused_ops.qk_norm_rope_kv_torch(qkv, qw, kw, 1e-6, cos, sin, pos, kc, vc,
                                                                        slots, hq, hkv)),
            "silu_mul": (lambda: fused_ops.silu_mul_triton(gu), lambda: fused_ops.silu_mul_torch(gu)),
        }
        for name, (fused, ref) in cases.items():
            a, b = fused(), ref()
            a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
            out.append({"kernel": name, "tokens": t, "fused_us": time_us(fused), "torch_us": time_us(ref),
                        "max_err": (a.float() - b.float()).abs().max().item()})
    return out


def split_table(rows: list[dict]) -> None:
    """The best config per K split of each projection (--skinny-split)."""
    print("projection  split  best us (GiB/s)  BN/BK/stages")
    for r in rows:
        for sk in (1, 2, 4):
            ok = [c for c in r["configs"] if "us" in c and c.get("split_k", 1) == sk]
            if ok:
                b = min(ok, key=lambda c: c["us"])
                print(f"{r['proj']:10s} {sk:6d} {b['us']:8.1f} ({b['gib_s']:5.0f})  "
                      f"{b['BLOCK_N']}/{b['BLOCK_K']}/{b['num_stages']}")


LM_HEAD_ROWS = (1, 4, 16, 32, 64, 256, 2048)


def lm_head_rows(dev, dtype, vocab: int = 151936, hidden: int = 4096, rows_list=LM_HEAD_ROWS) -> list[dict]:
    """The LM head at the 8B shape (Qwen3's vocabulary): µs per call of the bf16 output cast to float32 (vLLM's,
    `--disable-fp32-lm-head`) against cuBLAS's float32-output GEMM (scheduler/model.py `logits_of`), each over 4
    weight copies in turn (1.2 GiB each, none served from L2); and each one's largest error against a float64
    product of the same operands."""
    import torch.nn.functional as F
    weights = [torch.randn(vocab, hidden, device=dev, dtype=dtype) / hidden ** 0.5 for _ in range(4)]
    rows = []
    for m in rows_list:
        x = torch.randn(m, hidden, device=dev, dtype=dtype)
        want = x.double() @ weights[0].double().t()
        r = {"rows": m, "weight_mib": vocab * hidden * weights[0].element_size() / 2**20}
        for name, fn in (("model_dtype", lambda w: F.linear(x, w).float()),
                         ("fp32", lambda w: torch.mm(x, w.t(), out_dtype=torch.float32))):
            r[f"{name}_us"] = time_calls_us([functools.partial(fn, w) for w in weights * 2])
            r[f"{name}_max_err"] = (fn(weights[0]).double() - want).abs().max().item()
        r["fp32_over_model_dtype"] = r["fp32_us"] / r["model_dtype_us"]
        rows.append(r)
    del weights
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skinny", action="store_true", help="only the small-M projections (kernels/skinny_gemm.py)")
    ap.add_argument("--skinny-rows", type=int_list(1), default=None, metavar="M,M,...",
                    help="--skinny: these row counts, the default block config only (e.g. 1,16,32,64)")
    ap.add_argument("--skinny-split", action="store_true",
                    help="only the projections without SwiGLU at 16 rows, K split 1 / 2 / 4")
    ap.add_argument("--attention", action="store_true",
                    help="only the attention sweep: splits x block x warps x num_stages at 1 and 16 rows")
    ap.add_argument("--attention-rows", type=int, choices=(1, 16),
                    help="--attention: only the shapes with this many query rows per sequence")
    ap.add_argument("--attention-prefetch", action="store_true",
                    help="--attention: each config with the page prefetch off and on")
    ap.add_argument("--compile-jobs", type=positive_int, default=min(12, os.cpu_count() or 1),
                    help="--attention: processes that compile the sweep's kernels first (1: none)")
    ap.add_argument("--attention-batch", action="store_true",
                    help="only the attention of several sequences: one-row decode of 8 to 64 (1 to 16 splits), "
                         "verify steps and tails of 2 to 8 (4 to 16 splits)")
    ap.add_argument("--lm-head", action="store_true",
                    help="only the LM head: its bf16 output cast to float32 against a float32-output GEMM")
    add_common_args(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs CUDA", file=sys.stderr)
        return 2
    json_out = sys.stdout
    with human_output(args.json):  # (regression: the tables followed the JSON on stdout)
        return run(args, json_out)


def run(args, json_out) -> int:
    """The benchmark main() asked for: JSON to `json_out` with --json, tables to print()'s stdout."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if args.attention:
        res = attention_sweep(dev, dtype, args.compile_jobs, args.attention_rows, args.attention_prefetch)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        if args.json:
            print(json.dumps(res), file=json_out)
        sweep_table(res)
        return 0
    if args.attention_batch:
        res = {"device": torch.cuda.get_device_name(),
               "attention": attention_rows(dev, dtype, shapes=BATCH_SHAPES, configs=BATCH_CONFIGS)
               + attention_rows(dev, dtype, shapes=MULTI_ROW_SHAPES, configs=MULTI_ROW_CONFIGS)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        if args.json:
            print(json.dumps(res), file=json_out)
        print("seqs x rows  ctx  splits block      us   KV GiB/s  (- = the default)")
        for r in res["attention"]:
            cells = (f"{r['seqs']:4d} x {r['rows_per_seq']:<4d} {r['context']:5d} {r['splits'] or '-':>6}"
                     f" {r['block'] or '-':>5}")
            print(f"{cells}  failed: {r['error']}" if "error" in r else f"{cells} {r['us']:8.1f} {r['kv_gib_s']:9.0f}")
        return 0
    if args.lm_head:
        res = {"device": torch.cuda.get_device_name(), "lm_head": lm_head_rows(dev, dtype)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        if args.json:
            print(json.dumps(res), file=json_out)
        print("LM head rows  bf16 out + cast us  fp32 out us  ratio  max err bf16 / fp32")
        for r in res["lm_head"]:
            print(f"{r['rows']:12d} {r['model_dtype_us']:18.1f} {r['fp32_us']:12.1f} {r['fp32_over_model_dtype']:6.3f}"
                  f"  {r['model_dtype_max_err']:.2e} / {r['fp32_max_err']:.2e}")
        return 0
    if args.skinny_split:
        res = {"device": torch.cuda.get_device_name(),
               "skinny": skinny_rows(dev, dtype, rows_list=(16,), configs=SPLIT_CONFIGS,
                                     shapes=[sh for sh in SKINNY_SHAPES if not sh[3]])}
        split_table(res["skinny"])
    elif args.skinny and args.skinny_rows:
        res = {"device": torch.cuda.get_device_name(),
               "skinny": skinny_rows(dev, dtype, rows_list=args.skinny_rows,
                                     configs=[{}])}
    elif args.skinny:
        res = {"device": torch.cuda.get_device_name(), "skinny": skinny_rows(dev, dtype)}
    else:
        res = {"device": torch.cuda.get_device_name(), "attention": attention_rows(dev, dtype),
               "fused": fused_rows(dev, dtype), "skinny": skinny_rows(dev, dtype, configs=[{}])}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.json:
        print(json.dumps(res), file=json_out)
    print("projection rows  weight MiB  cuBLAS us (GiB/s)  skinny best us (GiB/s)  config  rel err")
    for r in res["skinny"]:
        b = r["best"] or {}
        cfg = "/".join(str(b.get(key, "-")) for key in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "split_k"))
        print(f"{r['proj']:10s} {r['rows']:4d} {r['weight_mib']:11.0f} {r['cublas_us']:9.1f} ({r['cublas_gib_s']:5.0f})"
              f" {b.get('us', float('nan')):14.1f} ({b.get('gib_s', float('nan')):5.0f})  {cfg}  {b.get('rel_err', float('nan')):.1e}")
    if args.skinny or args.skinny_split:
        return 0
    attention_table(res["attention"])
    print("kernel            tokens  fused us  torch us  max err")
    for r in res["fused"]:
        print(f"{r['kernel']:17s} {r['tokens']:6d} {r['fused_us']:9.1f} {r['torch_us']:9.1f} {r['max_err']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Micro-benchmark of the small-forward kernels at the 8B shape (Qwen3-8B: 32 query heads, 8 KV heads,
head dim 128, hidden 4096, intermediate 12288, bf16, page 16): the paged decode/tail attention in its
variants (splits, block, warps; timed inside a CUDA graph) and the fused element-wise kernels against
the torch ops they replace. Checks each against its torch reference; prints one table.

    python scripts/bench_kernels.py --json --out out/kernels.json     # on the GPU
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
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


def attention_rows(dev, dtype) -> list[dict]:
    hq, hkv, d, page = 32, 8, 128, 16
    rows = []
    for seqs, per, ctx in [(1, 1, 350), (1, 1, 1000), (1, 1, 3500), (1, 1, 8000), (32, 1, 576), (1, 16, 350),
                           (1, 16, 1000), (1, 16, 3500), (1, 16, 8000)]:
        pages_each = -(-(ctx + per) // page)
        num_pages = seqs * pages_each + 1
        k = torch.randn(num_pages, page, hkv, d, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        tables = torch.randperm(num_pages - 1, device=dev)[: seqs * pages_each].view(seqs, pages_each)
        lens = torch.tensor([ctx + t + 1 for _ in range(seqs) for t in range(per)], device=dev)
        q = torch.randn(seqs * per, hq, d, device=dev, dtype=dtype)
        ref = decode_attention_torch(q, k, v, tables, lens, d ** -0.5, per).float()
        kv_bytes = seqs * (ctx + per) * hkv * d * 2 * k.element_size()
        for splits in (8, 16, 32, 64):
            for block in (32, 64):
                for warps in (4, 8):
                    def fn():
                        return decode_attention_triton(q, k, v, tables, lens, d ** -0.5, per, block=block,
                                                       num_warps=warps, splits=splits)
                    err = (fn().float() - ref).abs().max().item()
                    us = time_us(fn)
                    rows.append({"seqs": seqs, "rows_per_seq": per, "context": ctx, "splits": splits,
                                 "block": block, "warps": warps, "us": us, "max_err": err,
                                 "kv_gib_s": kv_bytes / us / 1e3 / 1.073741824})
    return rows


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skinny", action="store_true", help="only the small-M projections (kernels/skinny_gemm.py)")
    ap.add_argument("--skinny-split", action="store_true",
                    help="only the projections without SwiGLU at 16 rows, K split 1 / 2 / 4")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs CUDA", file=sys.stderr)
        return 2
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if args.skinny_split:
        res = {"device": torch.cuda.get_device_name(),
               "skinny": skinny_rows(dev, dtype, rows_list=(16,), configs=SPLIT_CONFIGS,
                                     shapes=[sh for sh in SKINNY_SHAPES if not sh[3]])}
        split_table(res["skinny"])
    elif args.skinny:
        res = {"device": torch.cuda.get_device_name(), "skinny": skinny_rows(dev, dtype)}
    else:
        res = {"device": torch.cuda.get_device_name(), "attention": attention_rows(dev, dtype),
               "fused": fused_rows(dev, dtype), "skinny": skinny_rows(dev, dtype, configs=[{}])}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.json:
        print(json.dumps(res))
    print("projection rows  weight MiB  cuBLAS us (GiB/s)  skinny best us (GiB/s)  config  rel err")
    for r in res["skinny"]:
        b = r["best"] or {}
        cfg = "/".join(str(b.get(key, "-")) for key in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "split_k"))
        print(f"{r['proj']:10s} {r['rows']:4d} {r['weight_mib']:11.0f} {r['cublas_us']:9.1f} ({r['cublas_gib_s']:5.0f})"
              f" {b.get('us', float('nan')):14.1f} ({b.get('gib_s', float('nan')):5.0f})  {cfg}  {b.get('rel_err', float('nan')):.1e}")
    if args.skinny or args.skinny_split:
        return 0
    print("seqs x rows  ctx  splits block warps      us   KV GiB/s  max err   (best per shape marked *)")
    best = {}
    for r in res["attention"]:
        key = (r["seqs"], r["rows_per_seq"], r["context"])
        best[key] = min(best.get(key, 1e18), r["us"])
    for r in res["attention"]:
        star = "*" if r["us"] == best[(r["seqs"], r["rows_per_seq"], r["context"])] else " "
        print(f"{r['seqs']:4d} x {r['rows_per_seq']:<4d} {r['context']:5d} {r['splits']:6d} {r['block']:5d} "
              f"{r['warps']:5d} {r['us']:8.1f} {r['kv_gib_s']:9.0f} {r['max_err']:9.2e} {star}")
    print("kernel            tokens  fused us  torch us  max err")
    for r in res["fused"]:
        print(f"{r['kernel']:17s} {r['tokens']:6d} {r['fused_us']:9.1f} {r['torch_us']:9.1f} {r['max_err']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

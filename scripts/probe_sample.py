"""`scheduler.sampling.sample` alone on [B, vocab] float32 logits (what the LM head gives a decode step):
device and host milliseconds a call, the rejection kernel (kernels/rejection_sampling.py) against the
sort-based torch path, for a few batch sizes and the settings chat clients send. CUDA only.

    python3 scripts/probe_sample.py [--vocab 151936] [--batches 1,8,32,64] [--iterations 30] [--json]
    python3 scripts/probe_sample.py --sweep     (the kernel alone at block sizes, warps and stages)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from scheduler import sampling  # noqa: E402

SETTINGS = {  # name: (temperature, top_p, top_k, min_p, seeded)
    "top_p 0.95": (0.8, 0.95, 0, 0.0, False),
    "top_p 0.95 seeded": (0.8, 0.95, 0, 0.0, True),
    "top_p 0.5": (1.0, 0.5, 0, 0.0, False),
    "top_k 50": (0.8, 1.0, 50, 0.0, False),
    "min_p 0.05 + top_p 0.9": (0.8, 0.9, 0, 0.05, False),
    "top_k 20 + top_p 0.95": (0.6, 0.95, 20, 0.0, False),  # Qwen3's generation_config.json
}


def time_sample(logits: torch.Tensor, setting: tuple, iterations: int) -> tuple[float, float]:
    """(device ms, host ms) a call, medians."""
    temperature, top_p, top_k, min_p, seeded = setting
    b = logits.shape[0]
    gens = [torch.Generator(device="cuda").manual_seed(i) if seeded else None for i in range(b)]
    args = ([temperature] * b, [top_p] * b, gens, [top_k] * b, [min_p] * b)
    for _ in range(3):
        sampling.sample(logits, *args)
    torch.cuda.synchronize()
    device_ms, host_ms = [], []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        sampling.sample(logits, *args)
        end.record()
        host_ms.append((time.perf_counter() - t0) * 1e3)
        end.synchronize()
        device_ms.append(start.elapsed_time(end))
    return statistics.median(device_ms), statistics.median(host_ms)


def sweep(vocab: int, batches: list[int], iterations: int) -> list[dict]:
    """Device ms of the kernel alone (params packed beforehand), top_p 0.95 at temperature 0.8, per config."""
    from kernels.rejection_sampling import pack_params, sample_rows

    rows = []
    for b in batches:
        logits = torch.randn(b, vocab, device="cuda") * 3
        params = pack_params(list(range(b)), [0.8] * b, [0.95] * b, [-float("inf")] * b, [0] * b,
                             list(range(b))).cuda()
        for block in (2048, 4096):
            for warps in (8, 16):
                for stages in (1,):
                    cfg = dict(BLOCK=block, num_warps=warps, num_stages=stages)
                    try:
                        for _ in range(2):
                            sample_rows(logits, params, **cfg)
                    except Exception as exc:  # noqa: BLE001 - a config the compiler refuses (registers)
                        rows.append({"batch": b, **cfg, "error": str(exc).splitlines()[0][:80]})
                        continue
                    times = []
                    for _ in range(iterations):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        sample_rows(logits, params, **cfg)
                        end.record()
                        end.synchronize()
                        times.append(start.elapsed_time(end))
                    rows.append({"batch": b, **cfg, "device_ms": statistics.median(times)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="the kernel alone at each block size / warps / stages")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_sample.py needs CUDA", file=sys.stderr)
        return 2
    if args.sweep:
        found = sweep(args.vocab, [int(x) for x in args.batches.split(",")], args.iterations)
        for r in sorted(found, key=lambda r: (r["batch"], r.get("device_ms", 1e9))):
            print(json.dumps(r))
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        logits = torch.randn(b, args.vocab, device="cuda", generator=gen) * 3  # [B, V] float32
        for name, setting in SETTINGS.items():
            row = {"batch": b, "setting": name}
            for path, flag in (("kernel", True), ("torch", False)):
                sampling.USE_KERNEL = flag
                row[f"{path}_device_ms"], row[f"{path}_host_ms"] = time_sample(logits, setting, args.iterations)
            sampling.USE_KERNEL = None
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
    print(f"{'batch':>5} {'setting':<24} {'kernel dev ms':>13} {'host':>6} {'torch dev ms':>12} {'host':>6} {'x':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['setting']:<24} {r['kernel_device_ms']:>13.3f} {r['kernel_host_ms']:>6.3f} "
              f"{r['torch_device_ms']:>12.3f} {r['torch_host_ms']:>6.3f} "
              f"{r['torch_device_ms'] / r['kernel_device_ms']:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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


QUEUE_CYCLES = 4_000_000  # ~2 ms of torch.cuda._sleep before each timed call: its launches queue behind it


def time_sample(logits: torch.Tensor, setting: tuple, iterations: int) -> tuple[float, float]:
    """(device ms, host ms) a call, medians. The device's from events around the call's kernels queued
    behind a ~2 ms sleep kernel, as they queue behind a decode step's forward in the engine: what the
    device spends on them, not how fast the host launches them (the rejection kernels are 6 launches, 8 for a row with both top-k and top-p)."""
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
        torch.cuda._sleep(QUEUE_CYCLES)
        t0 = time.perf_counter()
        start.record()
        sampling.sample(logits, *args)
        end.record()
        host_ms.append((time.perf_counter() - t0) * 1e3)
        end.synchronize()
        device_ms.append(start.elapsed_time(end))
    return statistics.median(device_ms), statistics.median(host_ms)


def sweep(vocab: int, batches: list[int], iterations: int) -> list[dict]:
    """Device ms of the kernels alone (params packed beforehand; queued, as `time_sample`), top_p 0.95 at
    temperature 0.8 and top_k 50, per chunk size, warps and rounds split over a row's programs."""
    from kernels.rejection_sampling import pack_params, sample_rows

    rows = []
    for b in batches:
        logits = torch.randn(b, vocab, device="cuda") * 3
        for top_p, top_k in ((0.95, 0), (1.0, 50)):
            params = pack_params(list(range(b)), [0.8] * b, [top_p] * b, [-float("inf")] * b, [top_k] * b,
                                 list(range(b))).cuda()
            for chunk in (4096, 8192, 16384):
                for warps in (4, 8, 16):
                    for rounds in (1, 4, 8):
                        cfg = dict(CHUNK=chunk, num_warps=warps, ROUNDS=rounds)
                        try:
                            for _ in range(2):
                                sample_rows(logits, params, **cfg)
                        except Exception as exc:  # noqa: BLE001 - a config the compiler refuses (registers)
                            rows.append({"batch": b, "top_k": top_k, **cfg, "error": str(exc).splitlines()[0][:80]})
                            continue
                        times = []
                        for _ in range(iterations):
                            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            torch.cuda._sleep(QUEUE_CYCLES)  # (the launches queue: the device's time)
                            start.record()
                            sample_rows(logits, params, **cfg)
                            end.record()
                            end.synchronize()
                            times.append(start.elapsed_time(end))
                        rows.append({"batch": b, "top_k": top_k, **cfg, "device_ms": statistics.median(times)})
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

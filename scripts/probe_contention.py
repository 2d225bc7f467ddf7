"""Does a thread waiting on a CUDA event slow the main thread's launches? (GPU only)

    python3 scripts/probe_contention.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch


def host_us(fn, n=400):
    out = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t)
    return statistics.median(out) / 1e3, statistics.mean(out) / 1e3


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if not torch.cuda.is_available():  # (regression: --help ran the probe; the CPU got a traceback)
        print("probe_contention.py needs CUDA", file=sys.stderr)
        return 2
    try:
        print("cpu.max:", open("/sys/fs/cgroup/cpu.max").read().strip())
    except OSError as exc:
        print("cpu.max:", exc)
    print("nproc:", os.cpu_count(), "affinity:", len(os.sched_getaffinity(0)))
    a = torch.zeros(16, device="cuda")
    logits = torch.randn(16, 151936, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    ops = {"add_": lambda: a.add_(1), "argmax": lambda: torch.argmax(logits, dim=-1),
           "Event+record": lambda: torch.cuda.Event().record()}
    for mode in ("idle", "spin-wait thread", "blocking-wait thread"):
        stop = threading.Event()
        th = None
        if mode != "idle":
            blocking = mode.startswith("blocking")

            def waiter():
                s = torch.cuda.Stream()
                while not stop.is_set():
                    with torch.cuda.stream(s):
                        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time on its own stream
                        ev = torch.cuda.Event(blocking=blocking)
                        ev.record(s)
                    ev.synchronize()
            th = threading.Thread(target=waiter, daemon=True)
            th.start()
            time.sleep(0.05)
        row = []
        for name, fn in ops.items():
            med, mean = host_us(fn)
            row.append(f"{name} {med:.1f}/{mean:.1f}")
            torch.cuda.synchronize()
        stop.set()
        if th is not None:
            th.join()
        print(f"{mode:22s} us median/mean: " + "  ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())

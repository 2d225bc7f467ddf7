"""Does the way the loop waits for the GPU slow the host work that follows? (GPU only.)

The same host step (a 16-row tail's graph staging: fill_staging into pinned memory, one H2D copy,
an event record, plus a few small Python calls) is timed right after a ~5 ms GPU kernel ends,
waited for in each of these ways:
  loop-spin   the engine's spin (EngineConfig.gpu_wait="spin"): query the event, `await
              asyncio.sleep(0)` between queries, on uvloop (a loop iteration, an epoll_wait, per query)
  loop-hybrid query in a tight loop, yielding to the loop once every 100 us (fewer system calls;
              tried in the engine in session 12 and dropped: docs/benchmarks.md)
  tight       query in a tight loop (never yields)
  sync        event.synchronize() in an executor thread (gpu_wait="block")
  warm        no wait: the step right after itself (the tight-loop cost)
and, for each, the host CPU's own view (process time used during the step: a slow step with the
same CPU time was descheduled or stalled, not busier).

    python3 scripts/probe_wait.py [--repeats 200]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from scheduler.cuda_graphs import fill_staging  # noqa: E402

GPU_BUSY_CYCLES = 9_000_000  # ~5 ms at the H200's clock


def make_step():
    """One tail's graph staging, as DecodeGraphs.run does it (host arrays, one pinned -> device copy)."""
    rows, seqs, max_pages = 16, 1, 512
    host = torch.zeros(6 * rows + seqs * max_pages, dtype=torch.int64).pin_memory()
    dev = torch.zeros_like(host, device="cuda")
    ev = torch.cuda.Event()
    rows_np = host[:6 * rows].view(6, rows).numpy()
    tables_np = host[6 * rows:].view(seqs, max_pages).numpy()
    ids = list(range(15))
    table = list(range(100, 123))

    def step():
        fill_staging(rows_np, tables_np, (1, 16), ids, [336], [15], [table], 16, 0)
        dev.copy_(host, non_blocking=True)
        ev.record()
        return [x + 1 for x in ids], {"a": 1, "b": table[:4]}
    return step


async def measure(way: str, step, repeats: int, pool: ThreadPoolExecutor) -> tuple[float, float]:
    walls, cpus = [], []
    loop = asyncio.get_running_loop()
    for _ in range(repeats):
        if way != "warm":
            torch.cuda._sleep(GPU_BUSY_CYCLES)
            done = torch.cuda.Event()
            done.record()
            if way == "loop-spin":
                while not done.query():
                    await asyncio.sleep(0)
            elif way == "loop-hybrid":
                while not done.query():
                    until = time.perf_counter_ns() + 100_000
                    while time.perf_counter_ns() < until and not done.query():
                        pass
                    await asyncio.sleep(0)
            elif way == "tight":
                while not done.query():
                    pass
            elif way == "sync":
                await loop.run_in_executor(pool, done.synchronize)
        else:
            step()
        c, t = time.process_time_ns(), time.perf_counter_ns()
        step()
        walls.append(time.perf_counter_ns() - t)
        cpus.append(time.process_time_ns() - c)
        torch.cuda.synchronize()
    return statistics.median(walls) / 1e3, statistics.median(cpus) / 1e3


async def run(repeats: int) -> None:
    step = make_step()
    pool = ThreadPoolExecutor(1)
    for _ in range(20):
        step()
    print(f"{'wait':12s} {'step us':>8s} {'cpu us':>8s}   (median of {repeats})")
    for rnd in range(2):
        for way in ("warm", "loop-spin", "loop-hybrid", "tight", "sync"):
            wall, cpu = await measure(way, step, repeats, pool)
            print(f"{way:12s} {wall:8.1f} {cpu:8.1f}   round {rnd + 1}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_wait.py needs CUDA", file=sys.stderr)
        return 2
    import uvloop
    print(open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t"))
    for f in sorted(Path("/sys/devices/system/cpu/vulnerabilities").glob("*")):
        print(f"  {f.name}: {f.read_text().strip()}")
    uvloop.run(run(args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())

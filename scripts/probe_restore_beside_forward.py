"""What a layer-ordered restore running beside its forward costs that forward, on the device clock.
(GPU only.)

A restore hit's forward waits, layer by layer, for the copy that brings its prefix into L1
(hicache/transfer_layered.py), and shares the GPU with it: the copy kernel (kernels/host_copy.py)
takes SM time, the 2-D DMAs take only memory bandwidth but ~0.8 ms of host time to enqueue. This
probe times the 16-row tail graph over a prefix already in L1, each launch queued behind a ~1.5 ms
sleep kernel (so the host's enqueue is off the clock), with:
  plain        no copy: the engine's plain graph
  flags_set    the restore variant of the graph, its layer flags already set (the waits' own cost)
  dma          the restore variant behind a real restore of as many pages by the 2-D DMAs (all in
               layers: the engine's DMA restores longer than their forward move some pages whole first)
  kernelN      ... by the copy kernel with N programs
The copies write pages at the end of the L1 pool that nothing reads (their bytes do not matter to
the timing). Each row prints the device ms per round and the median host ms of the copy's enqueue.
Session 26 found this way that the copy kernel slows a 16-row forward by ~0.2 ms at 350 tokens
at 16-64 programs (more at 8 or 128), and that at 1,000-2,000 tokens 64 programs end the forward 0.2-0.7 ms
sooner than 16 (docs/benchmarks.md).

    python3 scripts/probe_restore_beside_forward.py
    python3 scripts/probe_restore_beside_forward.py --contexts 350,1000,2000 --variants plain,dma,kernel16,kernel64
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402
from scheduler.runner import BatchInput  # noqa: E402

SLEEP_CYCLES = 6_000_000  # ~3 ms on the H200: the enqueue (DMAs: up to ~0.95 ms) and the launch land behind it


def parse_variant(name: str) -> tuple[str, int]:
    """"plain" / "flags_set" / "dma" / "kernelN" -> (kind, programs)."""
    if name in ("plain", "flags_set", "dma"):
        return name, 0
    if name.startswith("kernel") and name[6:].isdigit() and int(name[6:]) > 0:
        return "kernel", int(name[6:])
    raise ValueError(f"unknown variant {name!r}: plain, flags_set, dma or kernelN (N programs)")


async def run(args) -> None:
    cfg = EngineConfig(model=args.model, device="cuda", page_size=16, max_total_tokens=args.pool_tokens,
                       max_prefill_tokens=16384, cuda_graphs=True, max_running_requests=64)
    engine = Engine(cfg.with_hicache(enable=True, policy="always", host_ratio=1.0))
    await engine.start()
    runner, tx = engine.runner, engine.cache.transfer
    if not tx.layerwise or not tx.host_reads:
        raise SystemExit("this machine has no layer-ordered restores or copy kernels")
    kernel_max_pages, programs = tx.kernel_max_pages, dict(tx.host_copy.programs)
    rng = random.Random(0)
    epoch = 0  # the last restore's: the flags_set variant waits for it (long landed)
    print(f"{'context':>7} {'variant':10s} device ms per round   enqueue host ms")
    for ctx in args.contexts:
        cached = [rng.randrange(1, engine.vocab_size) for _ in range(ctx)]
        async for _ in engine.submit(cached + [7], SamplingParams(max_tokens=1, ignore_eos=True)):
            pass
        await engine.cache.drain()
        m = engine.cache.match(cached)
        pages, length = list(m.pages[0]), m.lengths[0]
        n = min(16, length)  # the tail rows: as a 16-row graph runs them
        binput = BatchInput(list(cached[length - n:length]), [length - n], [n], [pages], [0.0], [1.0], [None],
                            is_decode=False)
        count, total = length // engine.page_size, engine.cache.l1.num_pages
        spare = list(range(total - 1 - count, total - 1))  # L1 pages nothing reads
        if set(spare) & set(pages):
            raise SystemExit("the pool is too small for spare pages: raise --pool-tokens")
        host = list(range(count))
        device_ms = {v: [] for v in args.variants}
        host_ms = {v: [] for v in args.variants}
        for _ in range(args.rounds):
            for v in args.variants:
                kind, progs = parse_variant(v)
                times = []
                for i in range(args.repeats + 2):  # two warm-ups (a new program count compiles)
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda._sleep(SLEEP_CYCLES)
                    start.record()
                    tr = None
                    t0 = time.perf_counter()
                    if kind in ("dma", "kernel"):
                        tx.kernel_max_pages = 0 if kind == "dma" else 1 << 30
                        tx.host_copy.programs["beside_forward"] = progs or programs["beside_forward"]
                        tr = tx.h2d_layerwise(host, spare)
                        if tr is None:
                            raise SystemExit("no layer-ordered restore for these pages: nothing to time")
                    enqueue = time.perf_counter() - t0
                    binput.wait_restore = kind != "plain"
                    binput.restore_epoch = tr.epoch if tr is not None else epoch
                    handle = runner.launch(binput)
                    end.record()
                    await runner.collect(handle)
                    if binput.wait_restore and runner.restore_wait_timed_out():
                        raise SystemExit(f"{v}: a layer wait gave up: that forward's time means nothing")
                    if tr is not None:
                        tx.wait_blocking(tr)
                        epoch = tr.epoch
                    end.synchronize()
                    if i >= 2:
                        times.append(start.elapsed_time(end))
                        host_ms[v].append(enqueue * 1e3)
                device_ms[v].append(statistics.median(times))
        tx.kernel_max_pages, tx.host_copy.programs = kernel_max_pages, dict(programs)
        for v in args.variants:
            print(f"{ctx:7d} {v:10s} {' '.join(f'{x:.3f}' for x in device_ms[v]):22s} "
                  f"{statistics.median(host_ms[v]):.3f}", flush=True)
    await engine.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--variants", default="plain,flags_set,dma,kernel16,kernel32,kernel64",
                    help="comma list of plain, flags_set, dma, kernelN")
    ap.add_argument("--contexts", default="350,1000,2000", help="cached tokens restored beside the forward")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=8, help="timed launches per variant and round")
    ap.add_argument("--pool-tokens", type=int, default=200_000)
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    try:
        for v in args.variants:
            parse_variant(v)
    except ValueError as exc:
        ap.error(str(exc))
    args.contexts = [int(c) for c in args.contexts.split(",")]
    if not torch.cuda.is_available():
        ap.error("this probe times CUDA graphs and copies: it needs a GPU")
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host time on the GPU machine (GPU only), two ways:
  1. each call a transfer or a restore makes (an event, a stream switch, a Triton launch, a DMA
     enqueue, a graph replay), µs per call, median of a tight loop;
  2. a 1,000-token D2H and H2D (TransferEngine) and a pinned copy_ of the same bytes, each split on
     the device clock into host time before its first device work, its device span and the time
     from its last device work until the caller's wait returned (session 9). Session 8's version
     stamped the D2H's steps after four ways of waiting: on the H200's host the same steps took about
     twice as long after a synchronize or a sleep as after polling (docs/benchmarks.md): why the
     engine's loop polls (EngineConfig.gpu_wait).

    python3 scripts/probe_host.py               # both
    python3 scripts/probe_host.py --transfers   # part 2 only
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kernels import page_copy  # noqa: E402


def host_us(fn, n=300, sync_every=50):
    """Median host µs of fn() over n calls (the device drained every `sync_every`)."""
    dev = torch.device("cuda")
    fn()
    torch.cuda.synchronize(dev)
    out = []
    for i in range(n):
        t = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t)
        if i % sync_every == 0:
            torch.cuda.synchronize(dev)
    torch.cuda.synchronize(dev)
    return statistics.median(out) / 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transfers", action="store_true", help="part 2 only")
    ap.add_argument("--pool-pages", type=int, default=0,
                    help="part 2's L1 pages (0: twice the transfer's, plus 8; see stamp_d2h)")
    ap.add_argument("--direct-pages", type=int, default=None,
                    help="part 2's TransferEngine.direct_pages (default: the engine's)")
    ap.add_argument("--sleepy", action="store_true",
                    help="part 2 waits as bench_transfer.py's harness does (sleep-poll, then synchronize)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():  # (regression: --help ran the probe; the CPU got a traceback)
        print("probe_host.py needs CUDA", file=sys.stderr)
        return 2
    if args.transfers:
        stamp_d2h(pool_pages=args.pool_pages, sleepy=args.sleepy, direct_pages=args.direct_pages)
        return 0
    dev = torch.device("cuda")
    pool_pages = 160
    l1 = torch.empty((2, 36, pool_pages, 16, 8, 128), dtype=torch.bfloat16, device=dev)
    packed = torch.empty((14, 2, 36, 16, 8, 128), dtype=torch.bfloat16, device=dev)
    host = torch.empty((14, 2, 36, 16, 8, 128), dtype=torch.bfloat16, pin_memory=True)
    idx = torch.arange(14, dtype=torch.int64, device=dev)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    ev = torch.cuda.Event()
    rows = {}
    rows["torch.cuda.Event()"] = host_us(lambda: torch.cuda.Event())
    rows["torch.cuda.Event(enable_timing)"] = host_us(lambda: torch.cuda.Event(enable_timing=True))
    rows["event.record(stream)"] = host_us(lambda: ev.record(s1))
    rows["stream.wait_event"] = host_us(lambda: s2.wait_event(ev))
    rows["stream.wait_stream"] = host_us(lambda: s2.wait_stream(s1))

    def ctx():
        with torch.cuda.stream(s1):
            pass
    rows["with torch.cuda.stream()"] = host_us(ctx)
    pages = list(range(63))
    rows["torch.tensor(63).to(non_blocking)"] = host_us(
        lambda: torch.tensor(pages, dtype=torch.int64).to(dev, non_blocking=True))
    pin = torch.zeros(256, dtype=torch.int64, pin_memory=True)
    dst = torch.zeros(256, dtype=torch.int64, device=dev)

    def pinned_idx():
        pin.numpy()[:63] = pages
        dst[:63].copy_(pin[:63], non_blocking=True)
    rows["pinned numpy fill + copy_(63)"] = host_us(pinned_idx)
    rows["slice packed[0:14]"] = host_us(lambda: packed[0:14])
    rows["gather_pages JIT launch (14 pages)"] = host_us(
        lambda: page_copy.gather_pages(l1, idx, packed, "triton"))
    rows["copy_ 33 MB D2H non_blocking (host)"] = host_us(lambda: host.copy_(packed, non_blocking=True),
                                                           n=60, sync_every=5)
    a = torch.zeros(16, device=dev)
    rows["tiny torch add_"] = host_us(lambda: a.add_(1))
    done = torch.cuda.Event()
    done.record()
    torch.cuda.synchronize()
    rows["event.synchronize (done)"] = host_us(lambda: done.synchronize())
    rows["event.query (done)"] = host_us(lambda: done.query())
    # graph of 330 tiny kernels
    g330 = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3):
            a.add_(1)
        with torch.cuda.graph(g330, stream=st):
            for _ in range(330):
                a.add_(1)
    torch.cuda.current_stream().wait_stream(st)
    rows["graph.replay (330 add kernels)"] = host_us(lambda: g330.replay(), n=100, sync_every=1)
    g330.upload() if hasattr(g330, "upload") else None
    # device time of the graph
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record()
    g330.replay()
    e1.record()
    torch.cuda.synchronize()
    rows["graph (330 adds) device us"] = e0.elapsed_time(e1) * 1e3
    # wall of launch + sync for graph: does the device start before replay returns?
    torch.cuda.synchronize()
    t = time.perf_counter_ns()
    g330.replay()
    t1 = time.perf_counter_ns()
    torch.cuda.synchronize()
    t2 = time.perf_counter_ns()
    rows["graph replay call / call+sync wall us"] = f"{(t1 - t) / 1e3:.1f} / {(t2 - t) / 1e3:.1f}"
    print(f"{'call':45s} host us")
    for k, v in rows.items():
        print(f"{k:45s} {v if isinstance(v, str) else f'{v:8.1f}'}")
    stamp_d2h(pool_pages=args.pool_pages, sleepy=args.sleepy, direct_pages=args.direct_pages)
    return 0


def stamp_d2h(n_pages=62, repeats=30, pool_pages=0, sleepy=False, direct_pages=None):
    """TransferEngine.d2h / h2d + wait_blocking of a 1,000-token (62-page) transfer of the 8B shape,
    and a pinned copy_ of the same bytes, stamped on the device clock: events recorded on an idle
    side stream at the call, when the enqueue returned and when the wait returned carry the host's
    time, so the wall splits into host time before the transfer's first device work, its device
    span (its own events) and the time from its last device work to the caller having it back.
    pool_pages: L1 pages (default 2 n + 8; an L1 slab row is pool_pages x 32 KiB long, the pitch of
    a direct 2-D DMA); sleepy: before each run wait as bench_transfer.py's harness does (poll with
    time.sleep(0), then synchronize) instead of spinning on an event as the engine's loop does.
    direct_pages: TransferEngine.direct_pages (default: the engine's)."""
    import random

    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import ChosenBackends

    dev = torch.device("cuda")
    geom = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    l1 = DevicePool(geom, pool_pages or 2 * n_pages + 8, dev)
    l2 = HostPool(geom, 2 * n_pages + 8, pin=True)
    eng = TransferEngine(l1, l2, ChosenBackends("triton", "triton", {}, "probe"))
    if direct_pages is not None:
        eng.direct_pages = direct_pages
    l1_pages = random.Random(0).sample(range(l1.num_pages), n_pages)
    host_pages = list(range(n_pages))
    nbytes = n_pages * geom.bytes_per_page
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()

    def engine(direction):
        tr = eng.d2h(l1_pages, host_pages) if direction == "d2h" else eng.h2d(host_pages, l1_pages)
        return tr, lambda: eng.wait_blocking(tr)

    def pinned(direction):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        (flat_host.copy_(flat_dev, non_blocking=True) if direction == "d2h"
         else flat_dev.copy_(flat_host, non_blocking=True))
        end.record()

        def wait():
            while not end.query():
                time.sleep(0)
        return type("T", (), {"start_event": start, "event": end})(), wait

    for what, run in (("engine", engine), ("pinned copy", pinned)):
        for direction in ("d2h", "h2d"):
            rows = []
            for i in range(repeats + 1):
                done = torch.cuda.Event()
                done.record()
                while not done.query():  # the loop's way of waiting (EngineConfig.gpu_wait)
                    if sleepy:
                        time.sleep(0)
                if sleepy:
                    torch.cuda.synchronize()
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                marks[0].record(side)
                tr, wait = run(direction)
                marks[1].record(side)
                wait()
                marks[2].record(side)
                torch.cuda.synchronize()
                if i:  # the first one warms up
                    rows.append([marks[0].elapsed_time(tr.start_event), marks[0].elapsed_time(marks[1]),
                                 tr.start_event.elapsed_time(tr.event), tr.event.elapsed_time(marks[2]),
                                 marks[0].elapsed_time(marks[2])])
            med = [statistics.median(r[k] for r in rows) * 1e3 for k in range(5)]
            print(f"--- {what} {direction}, {n_pages} pages of {l1.num_pages}{', sleepy' if sleepy else ''}, direct {eng.direct_pages} (median of {repeats}, us on the device clock): "
                  f"call -> first device work {med[0]:.0f}, call -> enqueue returned {med[1]:.0f}, "
                  f"device span {med[2]:.0f}, last device work -> wait returned {med[3]:.0f}, wall {med[4]:.0f}")
    eng.close()


if __name__ == "__main__":
    sys.exit(main())

"""Host time on the GPU machine (GPU only), two ways:
  1. each call a transfer or a restore makes (an event, a stream switch, a Triton launch, a DMA
     enqueue, a graph replay), µs per call, median of a tight loop;
  2. the steps of a 1,000-token D2H (TransferEngine), stamped from the call, after the thread waited
     for the device four ways: in torch.cuda.synchronize, polling an event, synchronize followed by
     1 ms of Python spinning, a 2 ms sleep. On the H200's host the same steps took about twice as
     long after a synchronize or a sleep as after polling (docs/benchmarks.md, session 8): why the
     engine's loop polls (EngineConfig.gpu_wait).

    python3 scripts/probe_host.py
"""
from __future__ import annotations

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


def main() -> int:
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
    stamp_d2h()
    return 0


def stamp_d2h(n_pages=63, repeats=30):
    """The steps of TransferEngine.d2h + wait_blocking for a 1,000-token (63-page) D2H of the 8B
    shape, stamped: host us from the call to the end of each step (median), and the device span."""
    import random

    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import ChosenBackends

    dev = torch.device("cuda")
    geom = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    l1 = DevicePool(geom, 2 * n_pages + 8, dev)
    l2 = HostPool(geom, 2 * n_pages + 8, pin=True)
    eng = TransferEngine(l1, l2, ChosenBackends("triton", "triton", {}, "probe"))
    l1_pages = random.Random(0).sample(range(l1.num_pages), n_pages)
    host_pages = list(range(n_pages))
    eng.wait_blocking(eng.d2h(l1_pages, host_pages))
    for wait in ("synchronize", "query spin", "synchronize + 1 ms Python spin", "sleep 2 ms"):
        stamp_once(eng, l1, l2, geom, l1_pages, host_pages, n_pages, repeats, wait)
    eng.close()


def stamp_once(eng, l1, l2, geom, l1_pages, host_pages, n_pages, repeats, wait):
    """TransferEngine.d2h's steps (its _enqueue and _pipelined, spelled out) with a stamp after each."""
    from hicache.transfer import RAMP_GROWTH, Transfer, host_runs, ramp_chunks
    from kernels.page_copy import gather_pages

    stamps: dict[str, list[float]] = {}
    for _ in range(repeats):
        torch.cuda._sleep(1_000_000)  # the device busy for ~0.5 ms, as after a forward
        if wait == "query spin":
            ev = torch.cuda.Event()
            ev.record()
            while not ev.query():
                pass
        elif wait == "sleep 2 ms":
            time.sleep(0.002)
        else:
            torch.cuda.synchronize()
        if wait.endswith("Python spin"):
            t_end = time.perf_counter_ns() + 1_000_000
            while time.perf_counter_ns() < t_end:
                pass
        marks = []
        t0 = time.perf_counter_ns()

        def mark(name):
            marks.append((name, (time.perf_counter_ns() - t0) / 1e3))
        host_runs(host_pages)
        mark("host_runs")
        ws, _ = eng._acquire(n_pages, needs_host=False)
        mark("acquire")
        idx = eng._index(l1_pages)
        mark("index to device")
        packed, host = ws.device[:n_pages], l2.page_buffer[0:n_pages]
        tr = Transfer("d2h", n_pages, n_pages * geom.bytes_per_page, 0, 0, t0, workspace=ws, keepalive=[idx])
        mark("Transfer()")
        ks, cs = eng.kernel_streams["d2h"], eng.copy_streams["d2h"]
        ks.wait_stream(torch.cuda.current_stream())
        tr.start_event, tr.event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cs.wait_stream(ks)
        tr.start_event.record(ks)
        mark("streams + events")
        lo = 0
        for i, size in enumerate(ramp_chunks(n_pages, eng.first_chunk_pages, RAMP_GROWTH)):
            hi = lo + size
            ready = torch.cuda.Event()
            gather_pages(l1.kv, idx[lo:hi], packed[lo:hi], "triton", ks)
            mark(f"chunk {i} gather launched")
            ready.record(ks)
            cs.wait_event(ready)
            eng._dma(host, packed, lo, hi, cs)
            mark(f"chunk {i} DMA enqueued")
            lo = hi
        tr.event.record(cs)
        mark("end event")
        eng.wait_blocking(tr)
        mark("wait_blocking returned")
        for name, us in marks:
            stamps.setdefault(name, []).append(us)
        stamps.setdefault("device span (events)", []).append(tr.start_event.elapsed_time(tr.event) * 1e3)
    print(f"--- 63-page D2H after: {wait} (median of {repeats}; host us since the call)")
    print("  " + "  ".join(f"{name} {statistics.median(v):.0f}" for name, v in stamps.items()))


if __name__ == "__main__":
    sys.exit(main())

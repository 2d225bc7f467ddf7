"""Where a layer-ordered restore's DMAs lose against one plain pinned copy, and whether spreading
them over several copy streams wins it back (H2D, pinned L2 -> L1 pages, the 8B shape by default).

Paths, each timed on the device (events) and on the host (enqueue, wall), median of --iterations:
  copy            one cudaMemcpyAsync of the whole byte count (the floor's copy)
  layers/sN       the 2-D DMA plan of hicache/layer_copy.py (2 DMAs a layer, consecutive pages),
                  layer l on stream l % N, its flag written there behind it (N=1: the engine's path)
  layers/s1/noflag  the same without the flag writes
  pages/sN        fragmented host pages: one 1-D DMA per page into a packed device buffer, page i
                  on stream i % N (what a per-run DMA plan of fragmented pages would do)
  kernel          fragmented host pages by the layer-ordered copy kernel (kernels/host_copy.py)
  d2h copy / d2h pages/sN / d2h kernel  the mirror for backups into fragmented host pages
Then (--sections load) the --load-paths restores at 1,000 and 3,504 tokens beside a load (--loads):
gemms, a model-like stream of skinny GEMMs (weights streamed from HBM), both ways slowed; spin, a
wait kernel on every SM; spin16 / spin16sleep / spin16sleep1k, 16 programs an SM spinning, with a
256 / 1,024 ns nanosleep between loads. Every restore timed alone is checked byte for byte against
L2; those beside a load, by their layer flags.

    python3 scripts/probe_copy_streams.py --out docs/results/copy_streams_8b.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hicache.layer_copy import layer_plan, run_layer_cuda  # noqa: E402
from kernels.cuda_rt import memcpy_async  # noqa: E402
from kernels.host_copy import HostCopy  # noqa: E402
from kernels.layer_flags import LayerFlags  # noqa: E402
from scheduler.presets import get_preset  # noqa: E402
from bench_common import add_common_args  # noqa: E402  (scripts/, next to this one)
from bench_layer_copy import median, restore_pools  # noqa: E402


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _spin_kernel(flags_ptr, layer, want, max_spins, SLEEP_NS: tl.constexpr):
    """Every program spins on flags[layer] (a forward's attention waiting for a layer), with a
    nanosleep between loads when SLEEP_NS > 0."""
    seen = tl.load(flags_ptr + layer, volatile=True)
    spins = 0
    while (seen < want) & (spins < max_spins):
        if SLEEP_NS > 0:
            tl.inline_asm_elementwise("nanosleep.u32 $1;\n mov.u32 $0, $1;", "=r,r", [spins * 0 + SLEEP_NS],
                                      dtype=tl.int32, is_pure=False, pack=1)
        seen = tl.load(flags_ptr + layer, volatile=True)
        spins += 1



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, model="qwen3-8b", page_size=16, output=False)  # --out alone (no --json) below
    ap.add_argument("--tokens", default="350,1000,3504,8000")
    ap.add_argument("--streams", default="1,2,3,4")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--sections", default="rows,load", help="rows (alone) and/or load (beside a load)")
    ap.add_argument("--load-paths", default="copy,layers/s1,layers/s2,layers/s3,kernel,pages/s2",
                    help="paths timed beside the load; layers/s1/noflag, layers/s1/memset and "
                         "layers/s1/nobarrier write the flags otherwise (none, cuMemsetD32Async, an unfenced write)")
    ap.add_argument("--loads", default="gemms", help="gemms (skinny GEMMs) and/or spin (a wait kernel on every SM)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_copy_streams needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    cfg = get_preset(args.model)
    sizes = [int(t) for t in args.tokens.split(",")]
    stream_counts = [int(s) for s in args.streams.split(",")]
    geo, l1, l2, pool_pages = restore_pools(args.model, args.page_size, max(sizes))
    page_bytes = geo.bytes_per_page
    max_pages = -(-max(sizes) // args.page_size)
    packed = torch.empty(geo.page_major_shape(max_pages), dtype=geo.dtype, device=dev)
    flags = LayerFlags(geo.num_layers, dev)
    counts = torch.zeros(geo.num_layers, dtype=torch.int32, device=dev)
    streams = [torch.cuda.Stream(dev) for _ in range(max(stream_counts))]
    kernel = HostCopy(l2, l1)  # (a restore's programs: 16 until session 26, 64 since on the H200)
    kernel.warm_up(counts, flags.flags)
    rng = random.Random(0)
    l1_ptr, l2_ptr, packed_ptr = l1.data_ptr(), l2.data_ptr(), packed.data_ptr()
    out: dict = {"model": args.model, "device": torch.cuda.get_device_name(dev), "page_bytes": page_bytes,
                 "date": time.strftime("%Y-%m-%d"), "rows": [], "under_load": []}

    def pages_for(tokens: int) -> int:
        return -(-tokens // args.page_size)

    def layout(n: int, frag: bool) -> tuple[list[int], list[int]]:
        if frag:
            return rng.sample(range(pool_pages), n), rng.sample(range(pool_pages), n)
        h0, d0 = rng.randrange(pool_pages - n), rng.randrange(pool_pages - n)
        return list(range(h0, h0 + n)), list(range(d0, d0 + n))

    def enqueue(kind: str, n: int, host: list[int], dst: list[int], k: int, epoch: int):
        """Enqueue one transfer over streams[:k] (each already waiting on the start); returns what
        to check afterwards."""
        if kind == "copy":
            memcpy_async(packed_ptr, l2_ptr + host[0] * page_bytes, n * page_bytes, streams[0])
        elif kind == "d2h copy":
            memcpy_async(l2_ptr + host[0] * page_bytes, packed_ptr, n * page_bytes, streams[0])
        elif kind.startswith("layers"):
            plan = layer_plan(geo, pool_pages, dst, host)
            for layer, copies in enumerate(plan):
                s = streams[layer % k]
                run_layer_cuda(copies, l1_ptr, l2_ptr, s)
                if "memset" in kind:
                    flags._memset(flags._base + 4 * layer, epoch, 1, s.cuda_stream)
                elif "nobarrier" in kind:
                    flags._write(s.cuda_stream, flags._base + 4 * layer, epoch, 1)
                elif "noflag" not in kind:
                    flags.signal(s, layer, epoch)
        elif kind == "pages":
            for i, h in enumerate(host):
                memcpy_async(packed_ptr + i * page_bytes, l2_ptr + h * page_bytes, page_bytes, streams[i % k])
        elif kind == "d2h pages":
            for i, h in enumerate(host):
                memcpy_async(l2_ptr + h * page_bytes, packed_ptr + i * page_bytes, page_bytes, streams[i % k])
        elif kind == "kernel":
            with torch.cuda.stream(streams[0]):
                pages = torch.tensor([host, dst], dtype=torch.int32).to(dev, non_blocking=True)
                kernel.h2d_layers(pages, counts, flags.flags, epoch, streams[0])
            return pages
        elif kind == "d2h kernel":
            with torch.cuda.stream(streams[0]):
                pages = torch.tensor([host, dst], dtype=torch.int32).to(dev, non_blocking=True)
                kernel.d2h_pages(pages, streams[0])
            return pages
        else:
            raise ValueError(kind)
        return None

    def timed(kind: str, n: int, host: list[int], dst: list[int], k: int, load=None) -> tuple[float, float, float, float]:
        """(enqueue ms, device ms, wall ms, load ms) of one transfer, optionally beside `load()`
        launched on the default stream right after the enqueue."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        la, lb = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        epoch = flags.next_epoch()
        t0 = time.perf_counter()
        start.record(streams[0])
        for s in streams[1:k]:
            s.wait_event(start)
        keep = enqueue(kind, n, host, dst, k, epoch)
        for s in streams[1:k]:
            ev = torch.cuda.Event()
            ev.record(s)
            streams[0].wait_event(ev)
        end.record(streams[0])
        t1 = time.perf_counter()
        if load is not None:
            la.record()
            load()
            lb.record()
        end.synchronize()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        del keep
        if kind in ("kernel",) or (kind.startswith("layers") and "noflag" not in kind):
            if int(flags.flags.min()) != epoch:
                raise RuntimeError(f"{kind}: a layer flag did not reach epoch {epoch}")
        return (t1 - t0) * 1e3, start.elapsed_time(end), (t2 - t0) * 1e3, (la.elapsed_time(lb) if load else 0.0)

    def check(kind: str, host: list[int], dst: list[int]) -> bool:
        n = len(host)
        idx = torch.tensor(host)
        if kind == "copy":
            return bool(torch.equal(packed[:n].cpu().view(torch.int16), l2[host[0]:host[0] + n].view(torch.int16)))
        if kind in ("pages",):
            return bool(torch.equal(packed[:n].cpu().view(torch.int16), l2[idx].view(torch.int16)))
        if kind.startswith("d2h"):
            want = packed[:n].cpu() if kind != "d2h kernel" else l1[:, :, dst].cpu().permute(2, 0, 1, 3, 4, 5)
            return bool(torch.equal(l2[idx].view(torch.int16), want.view(torch.int16)))
        got = l1[:, :, dst].cpu()  # [2, L, n, S, H, D]
        return bool(torch.equal(got.view(torch.int16), l2[idx].permute(1, 2, 0, 3, 4, 5).view(torch.int16)))

    def row(kind: str, tokens: int, frag: bool, k: int = 1) -> dict:
        n = pages_for(tokens)
        host, dst = layout(n, frag)
        if kind.startswith("d2h"):
            packed[:n].view(torch.int16).random_(-30000, 30000)
        enq, dev_ms, wall = [], [], []
        for it in range(args.iterations + 2):
            e, d, w, _ = timed(kind, n, host, dst, k)
            if it >= 2:
                enq.append(e), dev_ms.append(d), wall.append(w)
        name = kind if kind in ("copy", "kernel", "d2h copy", "d2h kernel") or "noflag" in kind else f"{kind}/s{k}"
        return {"path": name, "tokens": tokens, "pages": n, "fragmented": frag, "bytes": n * page_bytes,
                "enqueue_ms": median(enq), "device_ms": median(dev_ms), "wall_ms": median(wall),
                "identical": check(kind, host, dst)}

    for tokens in sizes if "rows" in args.sections else ():
        rows = [row("copy", tokens, False), row("layers/s1/noflag", tokens, False)]
        rows += [row("layers", tokens, False, k) for k in stream_counts]
        rows += [row("pages", tokens, True, k) for k in stream_counts] + [row("kernel", tokens, True)]
        rows += [row("d2h copy", tokens, False)] + [row("d2h pages", tokens, True, k) for k in stream_counts]
        rows += [row("d2h kernel", tokens, True)]
        for r in rows:
            base = next(x for x in rows if x["path"] == ("d2h copy" if r["path"].startswith("d2h") else "copy"))
            r["device_x_copy"] = base["device_ms"] / r["device_ms"]
            r["wall_x_copy"] = base["wall_ms"] / r["wall_ms"]
        out["rows"] += rows

    # beside a model-like load: 4 x 24 skinny GEMMs streaming ~3.5 GB of weights from HBM; or a
    # spinning wait kernel on every SM (a forward waiting for its layer), released at the end
    hidden = cfg.hidden_size
    weights = [torch.randn(hidden * 3, hidden, dtype=torch.bfloat16, device=dev) for _ in range(24)]
    x = torch.randn(15, hidden, dtype=torch.bfloat16, device=dev)
    spin_status = torch.zeros(1, dtype=torch.int32, device=dev)
    spin_expected = torch.zeros(1, dtype=torch.int64, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def gemms() -> None:
        for w in weights * 4:
            torch.matmul(x, w.t())

    def spin() -> None:  # spins until the last layer's flag reaches the transfer's epoch
        from kernels.layer_flags import _wait_kernel
        spin_expected.fill_(flags.epoch)
        _wait_kernel[(sms,)](flags.flags, spin_expected, spin_status, geo.num_layers - 1, 1 << 22)

    def spin_many(sleep_ns: int, programs: int):
        def go() -> None:
            _spin_kernel[(programs,)](flags.flags, geo.num_layers - 1, flags.epoch, 1 << 22, SLEEP_NS=sleep_ns,
                                      num_warps=4)
        return go

    loads = {"gemms": gemms, "spin": spin, "spin16": spin_many(0, 16 * sms), "spin16sleep": spin_many(256, 16 * sms),
             "spin16sleep1k": spin_many(1024, 16 * sms)}
    alone = []
    for _ in range(args.iterations):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        gemms()
        b.record()
        torch.cuda.synchronize()
        alone.append(a.elapsed_time(b))
    load_alone = median(alone)
    for load_name in args.loads.split(",") if "load" in args.sections else ():
        for tokens in sizes[1:3]:
            n = pages_for(tokens)
            for path in args.load_paths.split(","):
                kind, k = path, 1
                if path.startswith("layers") or path.startswith("pages"):
                    parts = path.split("/")
                    k = int(parts[1][1:])
                    kind = parts[0] + "".join("/" + p for p in parts[2:])
                frag = kind.startswith("pages") or kind == "kernel"
                if load_name.startswith("spin") and not (kind.startswith("layers") and "noflag" not in kind or kind == "kernel"):
                    continue  # the spin is released by the last layer's flag
                host, dst = layout(n, frag)
                res = [timed(kind, n, host, dst, k, load=loads[load_name]) for _ in range(args.iterations)]
                spin_status.zero_()
                out["under_load"].append({"tokens": tokens, "path": path, "load": load_name,
                                          "load_alone_ms": load_alone,
                                          "load_with_ms": median([r[3] for r in res]),
                                          "device_ms": median([r[1] for r in res])})

    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'tokens':>6} {'path':>18} {'frag':>5} {'enq ms':>7} {'dev ms':>7} {'wall ms':>8} {'dev x copy':>10} "
          f"{'wall x copy':>11} same")
    for r in out["rows"]:
        print(f"{r['tokens']:>6} {r['path']:>18} {str(r['fragmented']):>5} {r['enqueue_ms']:7.3f} {r['device_ms']:7.3f} "
              f"{r['wall_ms']:8.3f} {r['device_x_copy']:10.3f} {r['wall_x_copy']:11.3f} {r['identical']}")
    print(f"load alone {load_alone:.3f} ms")
    print(f"{'load':>6} {'tokens':>6} {'path':>20} {'load with ms':>12} {'copy dev ms':>11}")
    for r in out["under_load"]:
        print(f"{r['load']:>6} {r['tokens']:>6} {r['path']:>20} {r['load_with_ms']:12.3f} {r['device_ms']:11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Layer-ordered L2 -> L1 restores on the GPU: the 2-D DMA plan (hicache/layer_copy.py, copy engine)
against the one-launch copy kernel (kernels/host_copy.py, SMs reading pinned memory over PCIe).

For each prefix length: host time to enqueue, device time, wall time (enqueue to landed), the
effective GiB/s against a plain pinned H2D `copy_` of the same bytes measured here, and that the
kernel's L1 pages equal the DMA's byte for byte; then how much a model-like stream of small-M GEMMs
slows down while a restore runs beside it, and how long the restore takes under that load.

    python3 scripts/bench_layer_copy.py --model qwen3-8b --json --out docs/results/layer_copy_8b.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_cli import human_output, int_list, positive_int  # noqa: E402  (scripts/, next to this one)
from bench_common import add_common_args  # noqa: E402
from hicache.geometry import KVGeometry  # noqa: E402
from hicache.layer_copy import layer_plan, run_layer_cuda  # noqa: E402
from kernels.host_copy import HostCopy  # noqa: E402
from kernels.layer_flags import LayerFlags  # noqa: E402
from scheduler.presets import get_preset  # noqa: E402


def median(xs: list[float]) -> float:
    """The median: of an even count, the mean of the middle two (not the upper one)."""
    return statistics.median(xs)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def restore_pools(model: str, page_size: int, max_tokens: int):
    """(geometry, L1, L2, pool pages) for restores of up to `max_tokens` of the `model` preset's
    shape, bf16: an L1 pool of zeros [2, L, P, S, H, D] on CUDA and a pinned page-major L2 of random
    bits [P, 2, L, S, H, D], both of P = twice the pages plus 8 (room for disjoint page lists)."""
    cfg = get_preset(model)
    geo = KVGeometry(num_layers=cfg.num_layers, page_size=page_size, num_kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, dtype=torch.bfloat16)
    pool_pages = 2 * pages_for(max_tokens, page_size) + 8
    l1 = torch.zeros(geo.l1_shape(pool_pages), dtype=geo.dtype, device="cuda")
    l2 = torch.empty(geo.page_major_shape(pool_pages), dtype=geo.dtype, pin_memory=True)
    l2.view(torch.int16).random_(-30000, 30000)
    return geo, l1, l2, pool_pages


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, model="qwen3-8b", page_size=16)
    ap.add_argument("--tokens", type=int_list(1), default=[350, 1000, 3500, 8000], help="comma list")
    ap.add_argument("--programs", type=int_list(1), default=[8, 16, 32, 64, 132], help="comma list")
    ap.add_argument("--iterations", type=positive_int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_layer_copy needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    cfg = get_preset(args.model)
    sizes, programs = args.tokens, args.programs
    geo, l1, l2, pool_pages = restore_pools(args.model, args.page_size, max(sizes))
    flags = LayerFlags(geo.num_layers, dev)
    counts = torch.zeros(geo.num_layers, dtype=torch.int32, device=dev)
    stream = torch.cuda.Stream(dev)
    kernels = {p: HostCopy(l2, l1, programs=p) for p in programs}
    rng = random.Random(0)
    out: dict = {"model": args.model, "device": torch.cuda.get_device_name(dev), "page_bytes": geo.bytes_per_page,
                 "rows": [], "under_load": []}

    def peak_gib_s(nbytes: int) -> float:
        src = l2.reshape(-1)[: nbytes // 2]
        dst = torch.empty_like(src, device=dev)
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return nbytes / median(times) / (1 << 30)

    def run(kind: str, n: int, frag: bool, progs: int = 0) -> dict:
        if frag:
            host = rng.sample(range(pool_pages), n)
            dst = rng.sample(range(pool_pages), n)
        else:
            h0, d0 = rng.randrange(pool_pages - n), rng.randrange(pool_pages - n)
            host, dst = list(range(h0, h0 + n)), list(range(d0, d0 + n))
        enq, dev_ms, wall = [], [], []
        for it in range(args.iterations + 2):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            epoch = flags.next_epoch()
            t0 = time.perf_counter()
            start.record(stream)
            if kind == "dma":
                plan = layer_plan(geo, pool_pages, dst, host)
                if plan is None:
                    return {"kind": kind, "pages": n, "fragmented": frag, "skipped": "more than 8 runs"}
                for layer, copies in enumerate(plan):
                    run_layer_cuda(copies, l1.data_ptr(), l2.data_ptr(), stream)
                    flags.signal(stream, layer, epoch)
            else:
                with torch.cuda.stream(stream):
                    pages = torch.tensor([host, dst], dtype=torch.int32).to(dev, non_blocking=True)
                    kernels[progs].h2d_layers(pages, counts, flags.flags, epoch)
            end.record(stream)
            t1 = time.perf_counter()
            end.synchronize()
            t2 = time.perf_counter()
            if it >= 2:
                enq.append((t1 - t0) * 1e3)
                dev_ms.append(start.elapsed_time(end))
                wall.append((t2 - t0) * 1e3)
            if int(flags.flags.min()) != epoch:
                raise RuntimeError(f"{kind}: a layer flag did not reach epoch {epoch}")
        idx_h = torch.tensor(host)
        got = l1[:, :, dst].cpu()  # [2, L, n, S, H, D]
        want = l2[idx_h].permute(1, 2, 0, 3, 4, 5)
        return {"kind": kind, "programs": progs, "pages": n, "fragmented": frag,
                "enqueue_ms": median(enq), "device_ms": median(dev_ms), "wall_ms": median(wall),
                "equal": bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))}

    for tokens in sizes:
        n = pages_for(tokens, args.page_size)
        nbytes = n * geo.bytes_per_page
        peak = peak_gib_s(nbytes)
        for frag in (False, True):
            rows = [run("dma", n, frag)] + [run("kernel", n, frag, p) for p in programs]
            for r in rows:
                r.update(tokens=tokens, bytes=nbytes, peak_gib_s=peak)
                if "wall_ms" in r:
                    r["wall_gib_s"] = nbytes / (r["wall_ms"] / 1e3) / (1 << 30)
                    r["device_gib_s"] = nbytes / (r["device_ms"] / 1e3) / (1 << 30)
                out["rows"].append(r)

    # under load: a model-like stream of small-M GEMMs (memory bound, ~5 ms) on the default stream
    hidden = cfg.hidden_size
    weights = [torch.randn(hidden * 3, hidden, dtype=torch.bfloat16, device=dev) for _ in range(24)]
    x = torch.randn(15, hidden, dtype=torch.bfloat16, device=dev)

    def gemms() -> None:
        for w in weights * 4:
            torch.matmul(x, w.t())

    def load_ms(restore=None) -> tuple[float, float]:
        times, copy = [], []
        for _ in range(args.iterations):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            c0.record(stream)
            if restore is not None:
                restore()
            c1.record(stream)
            a.record()
            gemms()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
            copy.append(c0.elapsed_time(c1))
        return median(times), median(copy)

    for tokens in sizes[:2]:
        n = pages_for(tokens, args.page_size)
        host, dst = list(range(n)), list(range(n, 2 * n))
        plan = layer_plan(geo, pool_pages, dst, host)

        def dma():
            for layer, copies in enumerate(plan):
                run_layer_cuda(copies, l1.data_ptr(), l2.data_ptr(), stream)
                flags.signal(stream, layer, 1)

        def kernel(p):
            def go():
                with torch.cuda.stream(stream):
                    pages = torch.tensor([host, dst], dtype=torch.int32).to(dev, non_blocking=True)
                    kernels[p].h2d_layers(pages, counts, flags.flags, 1)
            return go
        alone, _ = load_ms()
        for name, fn in [("dma", dma)] + [(f"kernel/{p}", kernel(p)) for p in programs]:
            with_copy, copy_ms = load_ms(fn)
            out["under_load"].append({"tokens": tokens, "restore": name, "gemms_alone_ms": alone,
                                      "gemms_with_restore_ms": with_copy, "restore_ms": copy_ms})

    if args.json:
        print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    with human_output(args.json):  # (regression: the tables followed the JSON on stdout)
        human(out)
    return 0


def human(out: dict) -> None:
    print(f"{'tokens':>6} {'frag':>5} {'path':>10} {'enq ms':>7} {'dev ms':>7} {'wall ms':>8} "
          f"{'wall/peak':>9} {'dev/peak':>8} equal")
    for r in out["rows"]:
        if "wall_ms" not in r:
            print(f"{r['tokens']:>6} {str(r['fragmented']):>5} {r['kind']:>10} skipped: {r['skipped']}")
            continue
        name = r["kind"] if r["kind"] == "dma" else f"kernel/{r['programs']}"
        print(f"{r['tokens']:>6} {str(r['fragmented']):>5} {name:>10} {r['enqueue_ms']:7.3f} {r['device_ms']:7.3f} "
              f"{r['wall_ms']:8.3f} {r['wall_gib_s'] / r['peak_gib_s']:9.2f} "
              f"{r['device_gib_s'] / r['peak_gib_s']:8.2f} {r['equal']}")
    print(f"{'tokens':>6} {'restore':>10} {'gemms alone':>11} {'with restore':>12} {'restore ms':>10}")
    for r in out["under_load"]:
        print(f"{r['tokens']:>6} {r['restore']:>10} {r['gemms_alone_ms']:11.3f} {r['gemms_with_restore_ms']:12.3f} "
              f"{r['restore_ms']:10.3f}")


if __name__ == "__main__":
    sys.exit(main())

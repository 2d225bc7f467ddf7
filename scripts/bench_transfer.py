"""Transfer-engine benchmark: D2H / H2D of whole pages (gather/scatter kernel + one DMA) against a
plain pinned `copy_` of the same bytes measured in the same run, per backend, consecutive and
fragmented host pages; an L1 -> L2 -> L3 -> L2 -> L1 round trip checked byte for byte; L3 file
read/write and checksum throughput.

    python scripts/bench_transfer.py --json                       # GPU, 8B-shaped pages, bf16
    python scripts/bench_transfer.py --device cpu --quick         # CPU smoke
    python scripts/bench_transfer.py --page-size 1 --directions-only   # one-token pages
    python scripts/bench_transfer.py --page-size 1 --profile      # where one transfer's time goes
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch
import xxhash

sys.path.insert(0, os.path.dirname(__file__))
from bench_cli import check_device, choice_list, human_output, int_list, positive_int  # noqa: E402
from bench_common import add_common_args, fmt, write_result  # noqa: E402
from hicache.config import HiCacheConfig  # noqa: E402
from hicache.geometry import KVGeometry
from hicache.manager import CacheManager
from hicache.pools import DevicePool, HostPool
from hicache.radix import Tier
from hicache.storage import FileStore
from hicache.transfer import TransferEngine
from kernels.chooser import ChosenBackends
from scheduler.logs import configure_logging

GIB = 1 << 30


def sync(device):
    """Wait for the device by polling, as the engine's loop waits for a forward (EngineConfig.gpu_wait)
    and TransferEngine.wait_blocking for a transfer: a thread that slept in a synchronize runs its
    next ~0.3 ms of host work about half as fast on the H200's host, which would charge the pinned
    copy and the engine alike for a sleep the engine does not take."""
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            time.sleep(0)
        torch.cuda.synchronize(device)


def timed(fn, device, repeats):
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def event_timed(fn, device, repeats) -> float:
    """Median device time (CUDA events around fn on the current stream) in seconds; CPU: wall time."""
    if device.type != "cuda":
        return timed(fn, device, repeats)
    fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def pinned_copy_gib_s(nbytes, device, repeats) -> dict[str, float]:
    """The reference every ratio is taken against: a plain pinned `copy_` of `nbytes` each way,
    timed on the wall (launch to completion) and on the device (CUDA events around the copy)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2h, h2d = (lambda: host.copy_(dev, non_blocking=True)), (lambda: dev.copy_(host, non_blocking=True))
    return {"d2h": nbytes / timed(d2h, device, repeats) / GIB, "h2d": nbytes / timed(h2d, device, repeats) / GIB,
            "d2h_device": nbytes / event_timed(d2h, device, repeats) / GIB,
            "h2d_device": nbytes / event_timed(h2d, device, repeats) / GIB}


def profile_directions(geometry, device, tokens_list, repeats, backend, layouts) -> None:
    """Where a transfer's time goes: the enqueue's Python under cProfile (the functions with the most
    own time, over `repeats` transfers each way), then on CUDA one transfer each way under
    torch.profiler (kernels and copies by device time). Prints; measures nothing else."""
    pages_max = max(tokens_list) // geometry.page_size
    l1 = DevicePool(geometry, 2 * pages_max + 8, device)
    l2 = HostPool(geometry, 2 * pages_max + 8, pin=device.type == "cuda")
    engine = TransferEngine(l1, l2, ChosenBackends(backend, backend, {}, "bench"))
    for tokens in tokens_list:
        n = tokens // geometry.page_size
        l1_pages = torch.randperm(l1.num_pages)[:n].tolist()
        for layout in layouts:
            host_pages = list(range(n)) if layout == "consecutive" else list(range(0, 2 * n, 2))
            calls = {"d2h": lambda: engine.d2h(l1_pages, host_pages), "h2d": lambda: engine.h2d(host_pages, l1_pages),
                     "layer-ordered h2d": lambda: engine.h2d_layerwise(host_pages, l1_pages)}
            for name, call in calls.items():
                tr = call()
                if tr is None:
                    continue
                engine.wait_blocking(tr)  # warm: compile, workspaces
                prof, enqueue_us = cProfile.Profile(), []
                for _ in range(repeats):
                    sync(device)
                    prof.enable()
                    tr = call()
                    prof.disable()
                    engine.wait_blocking(tr)
                    enqueue_us.append((tr.enqueue_ns + tr.setup_ns) / 1e3)
                print(f"\n== {tokens} tokens ({n} pages), {layout}, {name}: enqueue median "
                      f"{statistics.median(enqueue_us):.0f} us over {repeats}; cProfile, us a transfer:")
                stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, ncalls, tottime, cumtime, callers)}
                top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
                print(f"{'own us':>8} {'cum us':>8} {'calls':>6}  function")
                for (file, line, func), (_, ncalls, own_s, cum_s, _) in top:
                    where = f"{os.path.basename(file)}:{line}({func})" if line else func
                    print(f"{own_s / repeats * 1e6:>8.1f} {cum_s / repeats * 1e6:>8.1f} {ncalls / repeats:>6.1f}  {where}")
                if device.type == "cuda":
                    from torch.profiler import ProfilerActivity, profile
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as torch_prof:
                        engine.wait_blocking(call())
                    print(torch_prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
    engine.close()


def bench_directions(geometry, device, tokens_list, repeats, backends, layouts=("consecutive", "fragmented"),
                     direct_list=(None,)):
    """direct_list: values of TransferEngine.direct_pages to compare (None: the engine's own), each
    row tagged with the value used."""
    pages_max = max(tokens_list) // geometry.page_size
    l1 = DevicePool(geometry, 2 * pages_max + 8, device)
    l1.kv.view(torch.uint8).random_()
    l2 = HostPool(geometry, 2 * pages_max + 8, pin=device.type == "cuda")
    rows = []
    for tokens in tokens_list:
        n = tokens // geometry.page_size
        nbytes = n * geometry.bytes_per_page
        ref = pinned_copy_gib_s(nbytes, device, repeats)
        d2h_peak, h2d_peak, d2h_dev_peak, h2d_dev_peak = ref["d2h"], ref["h2d"], ref["d2h_device"], ref["h2d_device"]
        l1_pages = torch.randperm(l1.num_pages)[:n].tolist()  # random L1 order: the gather does work
        for backend, direct in [(b, d) for b in backends for d in direct_list]:
            engine = TransferEngine(l1, l2, ChosenBackends(backend, backend, {}, "bench"))
            if direct is not None:
                if direct and engine._memcpy_2d is None:
                    raise SystemExit("--direct-pages: this machine has no 2-D DMA out of L1 (CUDA, pinned L2)")
                engine.direct_pages = direct
            for layout in layouts:
                host_pages = list(range(n)) if layout == "consecutive" else list(range(0, 2 * n, 2))

                service = {"d2h": [], "h2d": []}  # device time: first kernel/DMA start -> last one done
                enqueue = {"d2h": [], "h2d": []}  # host time to enqueue (workspace, indices, launches)

                def d2h():
                    tr = engine.wait_blocking(engine.d2h(l1_pages, host_pages))
                    service["d2h"].append(tr.service_ns)
                    enqueue["d2h"].append(tr.enqueue_ns + tr.setup_ns)

                def h2d():
                    tr = engine.wait_blocking(engine.h2d(host_pages, l1_pages))
                    service["h2d"].append(tr.service_ns)
                    enqueue["h2d"].append(tr.enqueue_ns + tr.setup_ns)
                t_d2h, t_h2d = timed(d2h, device, repeats), timed(h2d, device, repeats)
                s_d2h, s_h2d = (statistics.median(service[d][1:]) / 1e9 for d in ("d2h", "h2d"))
                rows.append({"tokens": tokens, "bytes": nbytes, "backend": backend, "host_layout": layout,
                             "direct_pages": engine.direct_pages,
                             "d2h_gib_s": nbytes / t_d2h / GIB, "h2d_gib_s": nbytes / t_h2d / GIB,
                             "pinned_d2h_gib_s": d2h_peak, "pinned_h2d_gib_s": h2d_peak,
                             "d2h_ratio": nbytes / t_d2h / GIB / d2h_peak,
                             "h2d_ratio": nbytes / t_h2d / GIB / h2d_peak,
                             # device-side: the engine's kernels + DMAs vs the bare DMA, both by CUDA events
                             "d2h_service_ratio": (nbytes / s_d2h / GIB / d2h_dev_peak) if s_d2h else None,
                             "h2d_service_ratio": (nbytes / s_h2d / GIB / h2d_dev_peak) if s_h2d else None,
                             "d2h_enqueue_us": statistics.median(enqueue["d2h"][1:]) / 1e3,
                             "h2d_enqueue_us": statistics.median(enqueue["h2d"][1:]) / 1e3,
                             "d2h_wall_us": t_d2h * 1e6, "h2d_wall_us": t_h2d * 1e6,
                             "d2h_service_us": s_d2h * 1e6, "h2d_service_us": s_h2d * 1e6})
            engine.close()
    return rows


async def round_trip(geometry, device, tokens, backend) -> bool:
    n = tokens // geometry.page_size
    tokens = n * geometry.page_size  # whole pages
    cfg = HiCacheConfig(enable=True, host_ratio=1.0, storage_ratio=2.0, policy="always",
                        transfer_backend=backend)
    mgr = CacheManager(geometry, 2 * n, device, cfg)
    claim = mgr.new_claim("bench")
    pages = mgr.alloc_l1(n, claim)
    idx = torch.tensor(pages, device=device)
    raw = mgr.l1.kv.view(torch.uint8)  # byte view: exact comparison for any dtype
    original = torch.randint(0, 256, raw[:, :, idx].shape, dtype=torch.uint8, device=device)
    raw[:, :, idx] = original
    tokens_ids = list(range(1, tokens + 1))
    mgr.insert_l1(tokens_ids, pages, claim, 0)  # write-through: D2H then H2S
    mgr.release_claim(claim)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 10 ** 9)
    mgr.tree.evict(Tier.L2, 10 ** 9)
    mgr.l1.kv.zero_()
    m = mgr.match(tokens_ids)
    assert m.lengths[Tier.L3] == tokens and m.lengths[Tier.L1] == 0 == m.lengths[Tier.L2]
    op = mgr.runner.start_restore(tokens_ids, m, "l3", "bench")
    await mgr.runner.wait_op(op)
    m = mgr.match(tokens_ids)
    got = mgr.l1.kv.view(torch.uint8)[:, :, torch.tensor(m.pages[Tier.L1], device=device)]
    ok = bool(torch.equal(got, original)) and m.lengths[Tier.L1] == tokens
    mgr.check_integrity()
    await mgr.close()
    return ok


def bench_storage(geometry, tokens, workers) -> dict:
    n = tokens // geometry.page_size
    host = torch.empty(geometry.page_major_shape(n), dtype=geometry.dtype, pin_memory=torch.cuda.is_available())
    host.view(torch.uint8).random_()
    out = {}
    # (a temporary file, removed as it closes: a fixed name in /tmp was left behind, and shared by two runs)
    with FileStore(geometry, n, io_workers=workers) as store:
        t = time.perf_counter()
        store.write_pages(host, list(range(n)), list(range(n))).result()
        os.fsync(store._fd)
        out["write_gib_s"] = host.numel() * host.element_size() / (time.perf_counter() - t) / GIB
        for cache in ("warm", "cold"):
            if cache == "cold":
                out["cold_allowed"] = store.drop_page_cache()
            t = time.perf_counter()
            res = store.read_pages(list(range(n)), host, list(range(n))).result()
            out[f"read_{cache}_gib_s"] = res.num_bytes / (time.perf_counter() - t) / GIB
    data = host.view(torch.uint8).numpy()
    t = time.perf_counter()
    xxhash.xxh3_64_intdigest(data)
    out["xxh3_gib_s"] = data.nbytes / (time.perf_counter() - t) / GIB
    return out


def bench_layerwise(geometry, device, tokens_list, repeats):
    """L2 -> L1 in layer order (2-D DMAs straight into consecutive L1 pages, one event per layer:
    what an overlapped restore uses) against the plain pinned copy of the same bytes."""
    pages_max = max(tokens_list) // geometry.page_size
    l1 = DevicePool(geometry, pages_max + 8, device)
    l2 = HostPool(geometry, 2 * pages_max + 8, pin=device.type == "cuda")
    l2.page_buffer.view(torch.uint8).random_()
    engine = TransferEngine(l1, l2, ChosenBackends("torch", "torch", {}, "bench"))
    rows = []
    if not engine.layerwise:
        return rows
    for tokens in tokens_list:
        n = tokens // geometry.page_size
        nbytes = n * geometry.bytes_per_page
        ref = pinned_copy_gib_s(nbytes, device, repeats)
        peak, dev_peak = ref["h2d"], ref["h2d_device"]
        # consecutive: the 2-D DMA plan; fragmented (every other host page): the copy kernel
        for layout in ("consecutive", "fragmented") if engine.host_reads else ("consecutive",):
            service = []
            l1_pages = list(range(4, 4 + n))
            host_pages = list(range(n)) if layout == "consecutive" else list(range(0, 2 * n, 2))

            def layerwise():
                service.append(engine.wait_blocking(engine.h2d_layerwise(host_pages, l1_pages)).service_ns)
            t = timed(layerwise, device, repeats)
            s = statistics.median(service[1:]) / 1e9 if device.type == "cuda" else None
            same = torch.equal(l1.kv[:, :, 4:4 + n].cpu().contiguous().view(torch.uint8),  # bytes: random bits hold NaNs
                               l2.buffer[:, :, host_pages].contiguous().view(torch.uint8))
            rows.append({"tokens": tokens, "bytes": nbytes, "host_layout": layout, "h2d_gib_s": nbytes / t / GIB,
                         "pinned_h2d_gib_s": peak, "h2d_ratio": nbytes / t / GIB / peak,
                         "h2d_service_ratio": (nbytes / s / GIB / dev_peak) if s else None, "identical": same})
    engine.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, device=True)  # its own --page-size below: the 8B-shaped KV's
    ap.add_argument("--tokens", type=int_list(1), default=[1000, 3504, 8000],
                    help="comma list of transfer sizes, each at least a page (--page-size)")
    ap.add_argument("--repeats", type=positive_int, default=10)
    ap.add_argument("--io-workers", type=positive_int, default=8)
    ap.add_argument("--backends", type=choice_list(("triton", "torch")), default=None,
                    help="comma list (default: triton,torch on CUDA, torch on the CPU)")
    ap.add_argument("--layouts", type=choice_list(("consecutive", "fragmented")), default="consecutive,fragmented",
                    help="host page layouts, comma list")
    ap.add_argument("--direct-pages", type=int_list(0), default=None,
                    help="comma list of a D2H's pages sent straight out of L1 to compare (default: the engine's)")
    ap.add_argument("--directions-only", action="store_true", help="skip the layer-ordered, round-trip and storage parts")
    ap.add_argument("--page-size", type=positive_int, default=16, help="tokens per page of the 8B-shaped KV (1: SGLang's default)")
    ap.add_argument("--profile", action="store_true",
                    help="print where one transfer's time goes (cProfile of the enqueue, torch.profiler) instead")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:  # (regression: torch's traceback)
        ap.error(f"--device {args.device}: not a torch device (cpu, cuda, cuda:N)")
    check_device(ap, device.type)
    if not args.quick and min(args.tokens) < args.page_size:  # (regression: "0 L1 pages vs 0 host pages")
        ap.error(f"--tokens: each size must be at least a page ({args.page_size} tokens), got "
                 f"{','.join(map(str, args.tokens))}")
    configure_logging(None)
    if args.quick:
        geometry = KVGeometry(2, 2, 16, 4, torch.float32)
        tokens_list, args.repeats = [64, 256], 3
    else:
        geometry = KVGeometry(36, 8, 128, args.page_size, torch.bfloat16)  # Qwen3-8B/4B KV geometry
        tokens_list = args.tokens
    backends = args.backends or (["triton", "torch"] if device.type == "cuda" else ["torch"])
    layouts = args.layouts
    direct_list = args.direct_pages or [None]
    if args.profile:
        with human_output(args.json):  # (stdout carries JSON alone with --json)
            profile_directions(geometry, device, tokens_list, args.repeats, backends[0], layouts)
        return 0
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%d"), "geometry": geometry.describe()}
    out["directions"] = bench_directions(geometry, device, tokens_list, args.repeats, backends, layouts, direct_list)
    out["layerwise_h2d"], out["round_trip_identical"], out["storage"] = [], {}, {}
    if not args.directions_only:
        out["layerwise_h2d"] = bench_layerwise(geometry, device, tokens_list, args.repeats)
        out["round_trip_identical"] = {b: asyncio.run(round_trip(geometry, device, tokens_list[0], b)) for b in backends}
        out["storage"] = bench_storage(geometry, tokens_list[-1] if not args.quick else 256, args.io_workers)
    write_result(out, args.out, args.json)
    with human_output(args.json):  # (regression: the table followed the JSON on stdout)
        human(out)
    ok = all(out["round_trip_identical"].values()) and all(r["identical"] for r in out["layerwise_h2d"])
    return 0 if ok else 1


def human(out: dict) -> None:
    print(f"\n{out['device']}: round trip byte-identical {out['round_trip_identical']}; storage {out['storage']}")
    print(f"{'tokens':>6} {'backend':>7} {'host':>11} {'direct':>6} {'D2H GiB/s':>10} {'ratio':>6} {'H2D GiB/s':>10} {'ratio':>6}"
          f"  device-time ratio D2H/H2D")
    for r in out["directions"]:
        dev = "/".join(f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("d2h_service_ratio", "h2d_service_ratio"))
        print(f"{r['tokens']:>6} {r['backend']:>7} {r['host_layout']:>11} {r['direct_pages']:>6} {r['d2h_gib_s']:>10.2f} "
              f"{r['d2h_ratio']:>6.3f} {r['h2d_gib_s']:>10.2f} {r['h2d_ratio']:>6.3f}  {dev}  enqueue us "
              f"{r['d2h_enqueue_us']:.0f}/{r['h2d_enqueue_us']:.0f}  wall us {r['d2h_wall_us']:.0f}/{r['h2d_wall_us']:.0f}"
              f"  device us {r['d2h_service_us']:.0f}/{r['h2d_service_us']:.0f}")
    for r in out["layerwise_h2d"]:
        print(f"{r['tokens']:>6} layer-ordered H2D {r['host_layout']:>11} {r['h2d_gib_s']:>7.2f} GiB/s  ratio {r['h2d_ratio']:.3f}  device "
              f"{fmt(r['h2d_service_ratio'], '{:.3f}')}  identical {r['identical']}")


if __name__ == "__main__":
    sys.exit(main())

"""What pinning L2 costs at start and whether the pinned bytes move at the copy's rate (GPU only):
a HostPool of --gib GiB (hicache/pinned.py: pageable zeros on torch's threads, then cudaHostRegister)
timed from the call to its return, and again torch's pinned allocator (`torch.zeros(...,
pin_memory=True)`) at --torch-gib; then --copy-mib H2D and D2H copies from each, GiB/s of the best
of --repeats; then the time to release each.

    python3 scripts/probe_pin.py --gib 64 --torch-gib 8
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hicache.geometry import KVGeometry  # noqa: E402
from hicache.pools import HostPool  # noqa: E402


def copy_gib_s(host: torch.Tensor, num_bytes: int, repeats: int) -> tuple[float, float]:
    """Best H2D and D2H GiB/s of `num_bytes` from the start of `host` (a pinned uint8 view)."""
    src = host.view(torch.uint8).view(-1)[:num_bytes]
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    rates = {"h2d": 0.0, "d2h": 0.0}
    for _ in range(repeats):
        for kind in rates:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if kind == "h2d":
                dev.copy_(src, non_blocking=True)
            else:
                src.copy_(dev, non_blocking=True)
            end.record()
            end.synchronize()
            rates[kind] = max(rates[kind], num_bytes / (start.elapsed_time(end) / 1e3) / (1 << 30))
    return rates["h2d"], rates["d2h"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=64.0)
    ap.add_argument("--torch-gib", type=float, default=8.0)
    ap.add_argument("--copy-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.cuda.init()
    geo = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    rows = []
    t = time.perf_counter()
    pool = HostPool(geo, int(args.gib * (1 << 30)) // geo.bytes_per_page, pin=True)
    made_s = time.perf_counter() - t
    reserved = torch.cuda.host_memory_stats().get("allocated_bytes.current", -1)
    h2d, d2h = copy_gib_s(pool.page_buffer, args.copy_mib << 20, args.repeats)
    t = time.perf_counter()
    del pool
    gc.collect()
    rows.append((f"HostPool (registered), {args.gib:g} GiB", made_s, h2d, d2h, time.perf_counter() - t, reserved))
    n = int(args.torch_gib * (1 << 30))
    t = time.perf_counter()
    buf = torch.zeros(n, dtype=torch.uint8, pin_memory=True)
    made_s = time.perf_counter() - t
    reserved = torch.cuda.host_memory_stats().get("allocated_bytes.current", -1)
    h2d, d2h = copy_gib_s(buf, args.copy_mib << 20, args.repeats)
    t = time.perf_counter()
    del buf
    torch._C._host_emptyCache()
    rows.append((f"torch pin_memory=True, {args.torch_gib:g} GiB", made_s, h2d, d2h, time.perf_counter() - t, reserved))
    print(f"{'L2 buffer':<40} {'made s':>8} {'H2D GiB/s':>10} {'D2H GiB/s':>10} {'freed s':>8} {'torch host reserved GiB':>24}")
    for name, made, h2d, d2h, freed, res in rows:
        print(f"{name:<40} {made:>8.2f} {h2d:>10.1f} {d2h:>10.1f} {freed:>8.2f} {res / (1 << 30):>24.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

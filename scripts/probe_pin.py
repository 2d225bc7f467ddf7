"""What pinning L2 costs at start and whether the pinned bytes move at the copy's rate (GPU only).

Each variant makes a zeroed, pinned host buffer of --gib GiB (torch's pinned allocator at
--torch-gib: it pins on one thread and would take minutes at 64 GiB), timed in two parts (the
memory zeroed, then pinned), then copies --copy-mib H2D and D2H from it (GiB/s, best of
--repeats), then releases it (timed):

  hostpool    hicache's HostPool as it is (hicache/pinned.py)
  zeros       torch.zeros (pageable, torch's threads fault it in), then cudaHostRegister
  thp_touch   an anonymous mmap advised MADV_HUGEPAGE, faulted in by torch's threads (zero_),
              then cudaHostRegister
  thp_driver  the same mmap registered untouched (the driver faults it in while pinning)
  torch       torch.zeros(..., pin_memory=True)

    python3 scripts/probe_pin.py --gib 64 --torch-gib 8
"""
from __future__ import annotations

import argparse
import gc
import mmap
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hicache.geometry import KVGeometry  # noqa: E402
from hicache.pools import HostPool  # noqa: E402

_FLAGS = 0x01 | 0x02  # portable | mapped, as hicache/pinned.py


def copy_gib_s(host: torch.Tensor, num_bytes: int, repeats: int) -> tuple[float, float]:
    """Best H2D and D2H GiB/s of `num_bytes` from the start of `host`."""
    src = host.view(-1).view(torch.uint8)[:num_bytes]
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


def register(buf: torch.Tensor) -> float:
    t = time.perf_counter()
    code = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), _FLAGS))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister failed: {code}")
    return time.perf_counter() - t


def huge_mmap(num_bytes: int) -> torch.Tensor:
    m = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.uint8)


def variant(name: str, num_bytes: int):
    """(buffer, zero s, pin s, release function)"""
    if name == "hostpool":
        geo = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
        t = time.perf_counter()
        pool = HostPool(geo, num_bytes // geo.bytes_per_page, pin=True)
        holder = [pool]  # the pool's registration ends with the pool: released by holder.clear()
        return pool.page_buffer, time.perf_counter() - t, 0.0, holder.clear
    t = time.perf_counter()
    if name == "torch":
        buf = torch.zeros(num_bytes, dtype=torch.uint8, pin_memory=True)
        return buf, time.perf_counter() - t, 0.0, torch._C._host_emptyCache
    if name == "zeros":
        buf = torch.zeros(num_bytes, dtype=torch.uint8)
    else:
        buf = huge_mmap(num_bytes)
        if name == "thp_touch":
            buf.zero_()
    zero_s = time.perf_counter() - t
    pin_s = register(buf)
    ptr = buf.data_ptr()
    return buf, zero_s, pin_s, lambda: torch.cuda.cudart().cudaHostUnregister(ptr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=64.0)
    ap.add_argument("--torch-gib", type=float, default=8.0)
    ap.add_argument("--variants", default="hostpool,zeros,thp_touch,thp_driver,torch")
    ap.add_argument("--copy-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():  # (regression: a "Torch not compiled with CUDA enabled" traceback)
        print("probe_pin.py needs CUDA", file=sys.stderr)
        return 2
    torch.cuda.init()
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        print("transparent_hugepage:", f.read().strip())
    rows = []
    for name in args.variants.split(","):
        num_bytes = int((args.torch_gib if name == "torch" else args.gib) * (1 << 30))
        buf, zero_s, pin_s, release = variant(name, num_bytes)
        pinned = buf.is_pinned()
        h2d, d2h = copy_gib_s(buf, args.copy_mib << 20, args.repeats)
        t = time.perf_counter()
        release()
        del buf
        gc.collect()
        rows.append((name, num_bytes / (1 << 30), zero_s, pin_s, pinned, h2d, d2h, time.perf_counter() - t))
        print(rows[-1], flush=True)
    print(f"{'variant':<11} {'GiB':>5} {'zero s':>7} {'pin s':>7} {'pinned':>6} {'H2D GiB/s':>10} {'D2H GiB/s':>10} {'freed s':>8}")
    for name, gib, zero_s, pin_s, pinned, h2d, d2h, freed in rows:
        print(f"{name:<11} {gib:>5.0f} {zero_s:>7.2f} {pin_s:>7.2f} {str(pinned):>6} {h2d:>10.1f} {d2h:>10.1f} {freed:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

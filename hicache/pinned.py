"""Pinned host memory for L2, pinned at its exact size and in seconds.

`torch.zeros(shape, pin_memory=True)` goes through torch's caching host allocator: one
cudaHostAlloc that faults in and pins every page on one thread (a 64 GiB L2 took 41.7 s on the
H200's host, session 31), and a block rounded up to a power of two (an L2 of 40 GiB pinned 64 GiB).
Here the memory is an anonymous mapping advised to use transparent huge pages, faulted in by
torch's CPU threads (`zero_`), then cudaHostRegister pins exactly those bytes with the flags
portable (every device's copies may use them) and mapped (the copy kernels of
kernels/host_copy.py read L2 by its host address, which under unified addressing is its device
address too). SGLang's host pool pins the same way. The registration ends with the owner
(`weakref.finalize`), before the memory is freed.

64 GiB on the H200's host (scripts/probe_pin.py, docs/benchmarks.md session 32), seconds to fault
in + pin, then to free: huge pages 2.5 + 1.8, then 1.4; torch.zeros' 4 KiB pages 3.4 + 3.3, then
5.1; the huge pages left for the driver to fault in while pinning, 16.6 (one thread). The copies
run at the same 51.5 GiB/s from every kind.
"""
from __future__ import annotations

import mmap
import weakref

import structlog
import torch

from kernels import cuda_rt

log = structlog.get_logger("hicache.pinned")

_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable
_REGISTER_MAPPED = 0x02    # cudaHostRegisterMapped


def pinned_zeros(owner: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor of `shape` pinned for as long as `owner` lives. Falls back to torch's
    pinned allocator (with a warning) where the runtime refuses to register the memory."""
    num_bytes = dtype.itemsize
    for n in shape:
        num_bytes *= n
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = _huge_page_zeros(num_bytes).view(dtype).view(shape)
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(buf.data_ptr(), num_bytes, _REGISTER_PORTABLE | _REGISTER_MAPPED))
    if code != 0:
        cuda_rt.clear_last_error()  # (else torch's next kernel launch raises it)
        log.warning("l2_host_register_failed", cuda_error=code, num_bytes=num_bytes,
                    fallback="torch pinned allocator")
        del buf
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    # the finalizer holds `buf`, so the memory outlives its registration; at exit the driver's
    # teardown unpins it anyway
    weakref.finalize(owner, _unregister, cudart, buf.data_ptr(), buf).atexit = False
    return buf


def _huge_page_zeros(num_bytes: int) -> torch.Tensor:
    """`num_bytes` zero bytes of anonymous memory (transparent huge pages where the kernel has them),
    faulted in by torch's threads; the tensor keeps the mapping alive."""
    region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages
            pass
    buf = torch.frombuffer(region, dtype=torch.uint8)
    buf.zero_()  # already zero: this faults the pages in on torch's threads, not the driver's one
    return buf


def _unregister(cudart, ptr: int, _buf: torch.Tensor) -> None:
    try:
        code = int(cudart.cudaHostUnregister(ptr))
    except Exception:  # noqa: BLE001 - at interpreter exit the runtime may be gone; the OS frees it all
        return
    if code != 0:  # the memory goes back to the OS with `_buf` all the same
        cuda_rt.clear_last_error()  # (else torch's next kernel launch on this thread raises it)
        log.warning("l2_host_unregister_failed", cuda_error=code)

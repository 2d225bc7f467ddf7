"""Pinned host memory for L2, pinned at its exact size and in seconds.

`torch.zeros(shape, pin_memory=True)` goes through torch's caching host allocator: one
cudaHostAlloc that faults in and pins every page on one thread (a 64 GiB L2 took 41.7 s on the
H200's host, session 31), and a block rounded up to a power of two (an L2 of 40 GiB pinned 64 GiB).
Here torch's CPU threads zero pageable memory first, then cudaHostRegister pins exactly those
bytes with the flags portable (every device's copies may use them) and mapped (the copy kernels of
kernels/host_copy.py read L2 by its host address, which under unified addressing is its device
address too). SGLang's host pool pins the same way. The registration ends with the owner
(`weakref.finalize`), before the memory is freed.
"""
from __future__ import annotations

import weakref

import structlog
import torch

log = structlog.get_logger("hicache.pinned")

_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable
_REGISTER_MAPPED = 0x02    # cudaHostRegisterMapped


def pinned_zeros(owner: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor of `shape` pinned for as long as `owner` lives. Falls back to torch's
    pinned allocator (with a warning) where the runtime refuses to register the memory."""
    buf = torch.zeros(shape, dtype=dtype)
    num_bytes = buf.numel() * buf.element_size()
    if num_bytes == 0:
        return buf
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(buf.data_ptr(), num_bytes, _REGISTER_PORTABLE | _REGISTER_MAPPED))
    if code != 0:
        log.warning("l2_host_register_failed", cuda_error=code, num_bytes=num_bytes,
                    fallback="torch pinned allocator")
        del buf
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    # the finalizer holds `buf`, so the memory outlives its registration; at exit the driver's
    # teardown unpins it anyway
    weakref.finalize(owner, _unregister, cudart, buf.data_ptr(), buf).atexit = False
    return buf


def _unregister(cudart, ptr: int, _buf: torch.Tensor) -> None:
    try:
        cudart.cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit the runtime may be gone; the OS frees it all
        pass

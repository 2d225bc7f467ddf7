"""The CUDA runtime call torch does not expose, bound with ctypes to the libcudart torch loaded:

  memcpy_2d_async   cudaMemcpy2DAsync: `height` rows of `width` bytes, each row at its own pitch on
                    either side, in one DMA. Moves one layer's slab of a run of pages out of
                    the page-major L2 into L1 without a host gather or a scatter kernel, and
                    a backup's first pages out of L1 (all 2L slabs of one page) before any
                    gather kernel has run.
  memcpy_async      cudaMemcpyAsync on a stream handle: one call, no `with torch.cuda.stream()`
                    around a `copy_` (~20 us of host time per chunk of a transfer pipeline).

  current_stream    torch.cuda.current_stream(device) without its Python: the stream objects are
                    cached by what torch's C call returns. On the H200's host (a microVM) the
                    plain call cost ~20-40 us, and a request's hot path (its restore's start,
                    its forward's staging) made a dozen of them before the device had work.

`available()` says whether the library was found; callers keep a plain path for when it was not.
(Forwards wait for such copies with kernels/layer_flags.py; an earlier cudaStreamWaitEvent binding
for external event-wait nodes in graphs was dropped: each wait cost ~17 us of device time.)
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

_HOST_TO_DEVICE = 1        # cudaMemcpyHostToDevice
_DEVICE_TO_HOST = 2        # cudaMemcpyDeviceToHost
_DEFAULT = 4               # cudaMemcpyDefault: the direction from the pointers (unified addressing)


@functools.lru_cache(maxsize=1)
def _lib():
    """The libcudart already mapped into this process (the one torch uses), else None."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "libcudart" in line and "/" in line]
    except OSError:
        pass
    candidates = list(dict.fromkeys(paths)) + [p for p in (ctypes.util.find_library("cudart"),) if p]
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            lib.cudaMemcpy2DAsync.restype = ctypes.c_int
            lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                              ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            lib.cudaMemcpyAsync.restype = ctypes.c_int
            lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                            ctypes.c_void_p]
            return lib
        except (OSError, AttributeError):
            continue
    return None


_streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """The current CUDA stream of `device` (the same stream `torch.cuda.current_stream(device)`
    returns: one C call and a dict lookup)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    data = torch._C._cuda_getCurrentStream(index)  # (stream id, device index, device type)
    stream = _streams.get(data)
    if stream is None:
        torch.cuda._lazy_init()  # (as torch.cuda.current_stream does: a forked child fails clearly)
        stream = _streams[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])
    return stream


def available() -> bool:
    return _lib() is not None


def clear_last_error() -> None:
    """Take a refused runtime call's error off this thread's last error. The runtime keeps it there, and torch's next
    kernel launch on the thread reads it (cudaGetLastError) and raises it as its own (regression: a transfer whose DMA
    was refused failed as it should, and then the forward launched next failed too, with the DMA's error)."""
    lib = _lib()
    if lib is not None:
        lib.cudaGetLastError()


def _check(code: int, what: str) -> None:
    if code != 0:
        clear_last_error()
        raise RuntimeError(f"{what} failed with CUDA error {code}")


def memcpy_2d_async(copies, stream: torch.cuda.Stream, to_host: bool = False) -> None:
    """Pinned host -> device copies (device -> pinned host with to_host), each (dst_ptr,
    dst_pitch_bytes, src_ptr, src_pitch_bytes, width_bytes, height): `height` rows of
    `width_bytes`, enqueued on `stream` in order (a copy engine does them, no SM is used). One
    Python call for many: a restore enqueues ~70 of them."""
    copy, handle = _lib().cudaMemcpy2DAsync, stream.cuda_stream
    kind = _DEVICE_TO_HOST if to_host else _HOST_TO_DEVICE
    for dst, dst_pitch, src, src_pitch, width, height in copies:
        code = copy(dst, dst_pitch, src, src_pitch, width, height, kind, handle)
        if code != 0:
            _check(code, "cudaMemcpy2DAsync")


def memcpy_async(dst_ptr: int, src_ptr: int, num_bytes: int, stream: torch.cuda.Stream) -> None:
    """`num_bytes` from src_ptr to dst_ptr (device or pinned host, either way) on `stream`. The
    caller keeps both buffers alive until the stream is past the copy."""
    _check(_lib().cudaMemcpyAsync(dst_ptr, src_ptr, num_bytes, _DEFAULT, stream.cuda_stream), "cudaMemcpyAsync")

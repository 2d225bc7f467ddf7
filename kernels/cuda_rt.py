"""The two CUDA runtime calls torch does not expose, bound with ctypes to the libcudart torch loaded:

  memcpy_2d_async   cudaMemcpy2DAsync: `height` rows of `width` bytes, each row at its own pitch on
                    either side, in one DMA. Moves one layer's slab of a run of pages out of
                    the page-major L2 into L1 without a host gather or a scatter kernel.
  wait_event        cudaStreamWaitEvent; while the stream is being captured into a CUDA graph it
                    passes cudaEventWaitExternal, so the graph gets an event-wait node on an event
                    recorded outside it (each replay waits for that event's latest record).

`available()` says whether the library was found; callers keep a plain path for when it was not.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

_HOST_TO_DEVICE = 1        # cudaMemcpyHostToDevice
_WAIT_EXTERNAL = 0x01      # cudaEventWaitExternal


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
            lib.cudaStreamWaitEvent.restype = ctypes.c_int
            lib.cudaStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def available() -> bool:
    return _lib() is not None


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


def memcpy_2d_async(dst_ptr: int, dst_pitch_bytes: int, src_ptr: int, src_pitch_bytes: int, width_bytes: int,
                    height: int, stream: torch.cuda.Stream) -> None:
    """Pinned host -> device copy of `height` rows of `width_bytes`, enqueued on `stream` (a copy
    engine does it, no SM is used)."""
    _check(_lib().cudaMemcpy2DAsync(dst_ptr, dst_pitch_bytes, src_ptr, src_pitch_bytes, width_bytes, height,
                                    _HOST_TO_DEVICE, stream.cuda_stream), "cudaMemcpy2DAsync")


def wait_event(event: torch.cuda.Event) -> None:
    """The current stream waits for `event`; inside a graph capture the wait becomes an external
    event-wait node (a plain cudaStreamWaitEvent there would be refused: the event is not captured)."""
    stream = torch.cuda.current_stream()
    if not torch.cuda.is_current_stream_capturing():
        stream.wait_event(event)
        return
    _check(_lib().cudaStreamWaitEvent(stream.cuda_stream, event.cuda_event, _WAIT_EXTERNAL), "cudaStreamWaitEvent")

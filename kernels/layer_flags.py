"""Layer-ready flags: how a forward waits, on the device, for the layers of a restore that is still
crossing PCIe (hicache/layer_copy.py), without CUDA events.

The copy stream writes `flags[l] = epoch` right behind layer l's DMAs (a stream memory operation:
cuStreamWriteValue32, which fences the writes before it; cuMemsetD32Async where stream memory
operations are off), or the copy kernel (kernels/host_copy.py) releases it when layer l's last
chunk is stored. The forward waits before layer l's attention until `flags[l] >= expected` (a device
scalar holding the restore's epoch): `spin_wait`, a volatile-load loop ending in one acquire read
(the release's counterpart), that the paged attention kernel runs first in each program
(`LayerWait.kernel_args`), or one tiny kernel before any other attention (`LayerWait(l)` /
`wait(l)`). Epochs only grow, so a later restore's write never releases an earlier forward too
soon: stream order puts it behind the earlier restore's copies. (Up to the int32 flags' limit:
there they start again from 1 with nothing in flight, `next_epoch`.)

Why not event-wait nodes: a captured graph with 36 external event waits cost ~17 us of device time
per wait (the graph runs in segments) and ~0.3 ms more host time per launch on the H200 (session 4
trace, docs/benchmarks.md); a spin kernel costs one small kernel.

Every flag write of a restore is enqueued before the forward that waits for it is launched.
Launching the forward first (to hide the ~0.5 ms of copy enqueueing under it) was tried on the H200
and dropped: the first such restore of a process saw its copies stall behind the spinning forward
until the waits gave up (CUDA promises streams no forward progress to each other). Tried again in
session 10 with the copy kernel of short restores launched right after the graph replay: the
first restore of an engine stalled the same way (1.3 s, then recomputed; the cost model then
stopped restoring for that engine), and an eager forward can deadlock outright, its host blocking
on a full launch queue behind a wait whose copy it has not launched yet.

A wait gives up after `max_spins` loads (~1.3 s; only a bug can get there: the copies have a
stream of their own and are enqueued first, and even 128 K tokens of an 8B model land in 0.4 s)
and sets `status` to 1; later waits of the same forward then pass at once, and the caller
discards that forward.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    triton = None

MAX_SPINS = 1 << 23  # ~0.16 us per volatile load on the H200: ~1.3 s
# Flags are int32 and a wait compares them with the epoch as an int32: epochs start again from 1
# before they would wrap (~25 days at 1,000 restores a second; LayerFlags.next_epoch)
EPOCH_LIMIT = (1 << 31) - 1


if triton is not None:
    @triton.jit
    def spin_wait(flags_ptr, expected_ptr, status_ptr, layer, max_spins):
        """Device side of a wait, for any kernel to call first: spin until flags[layer] >= expected,
        or give up after max_spins loads and set status (passing at once once status is set)."""
        want = tl.load(expected_ptr).to(tl.int32)
        seen = tl.load(flags_ptr + layer, volatile=True)
        spins = 0
        if tl.load(status_ptr, volatile=True) != 0:  # an earlier layer gave up: the output is void anyway
            spins = max_spins
        while (seen < want) & (spins < max_spins):
            seen = tl.load(flags_ptr + layer, volatile=True)
            spins += 1
        # the volatile loads are relaxed: one acquire read of the flag (an atomic add of 0, whose
        # value is at least the last one seen: flags only grow) orders this program's loads of the
        # layer's K/V after the release that published them (the copy kernel's atomic exchange, a
        # stream's fenced write), as the PTX memory model asks. Triton >= 3.3 lowers a 32-bit
        # acquire atomic add of 0 to a plain ld.acquire (triton-lang/triton#5187): no write
        seen = tl.atomic_add(flags_ptr + layer, 0, sem="acquire", scope="gpu")
        if seen < want:
            tl.store(status_ptr, 1)

    @triton.jit(do_not_specialize=["layer", "max_spins"])
    def _wait_kernel(flags_ptr, expected_ptr, status_ptr, layer, max_spins):
        spin_wait(flags_ptr, expected_ptr, status_ptr, layer, max_spins)


@functools.lru_cache(maxsize=1)
def _driver():
    """(cuStreamWriteValue32 or None, cuMemsetD32Async) from libcuda, or None without it."""
    if not torch.cuda.is_available():
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in ("cuStreamWriteValue32_v2", "cuStreamWriteValue32"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            break
    memset = lib.cuMemsetD32Async
    memset.restype = ctypes.c_int
    memset.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
    return fn, memset


class LayerFlags:
    """flags [L] int32 (device), status [1] int32 (device), expected [1] int64 (device, the eager
    forwards' epoch; a captured graph reads its own staged copy)."""

    def __init__(self, num_layers: int, device: torch.device, max_spins: int = MAX_SPINS) -> None:
        self.flags = torch.zeros(num_layers, dtype=torch.int32, device=device)
        self.status = torch.zeros(1, dtype=torch.int32, device=device)
        # host mirror of `status`, filled in stream order behind a forward (no extra sync to read it)
        self.status_host = torch.zeros(1, dtype=torch.int32, pin_memory=self.status.is_cuda)
        self.expected = torch.zeros(1, dtype=torch.int64, device=device)
        self.max_spins = max_spins
        self.epoch = 0
        self._write, self._memset, self._base = None, None, self.flags.data_ptr()
        if self.flags.is_cuda:  # on the CPU the copies are synchronous: nothing to signal
            driver = _driver()
            if driver is None:
                raise RuntimeError("layer flags need libcuda.so.1 (cuStreamWriteValue32 / cuMemsetD32Async)")
            self._write, self._memset = driver

    def next_epoch(self) -> int:
        """The next restore's epoch. At EPOCH_LIMIT the flags start again from 0, once every copy
        and forward in flight is done (a device synchronisation, once in 2^31 restores; a forward
        not yet launched for the last old epoch would time out, be discarded and run again). The
        zeroing runs on the caller's stream; the new epoch's flag writes come after it because
        every layer-ordered enqueue makes its copy stream wait on the caller's stream after this
        call (hicache/transfer_layered.py)."""
        if self.epoch >= EPOCH_LIMIT:
            if self.flags.is_cuda:
                torch.cuda.synchronize(self.flags.device)
            self.flags.zero_()
            self.epoch = 0
        self.epoch += 1
        return self.epoch

    def signal(self, stream: torch.cuda.Stream, layer: int, epoch: int) -> None:
        """In `stream`'s order, after what is already on it: flags[layer] = epoch."""
        addr = self._base + 4 * layer
        if self._write is not None:
            code = self._write(stream.cuda_stream, addr, epoch, 0)  # 0: fenced write
            if code == 0:
                return
            self._write = None  # stream memory operations are off on this machine: memset from now on
        code = self._memset(addr, epoch, 1, stream.cuda_stream)
        if code != 0:
            raise RuntimeError(f"cuMemsetD32Async failed with CUDA error {code}")

    def wait(self, layer: int, expected: torch.Tensor | None = None) -> None:
        """The current stream waits until flags[layer] >= expected (default: self.expected);
        capturable into a CUDA graph."""
        _wait_kernel[(1,)](self.flags, self.expected if expected is None else expected, self.status, layer,
                           self.max_spins, num_warps=1)

    def stage_status(self) -> None:
        """Enqueue the copy of `status` into `status_host` on the current stream (behind the waits)."""
        self.status_host.copy_(self.status, non_blocking=self.status.is_cuda)

    def staged_timed_out(self) -> bool:
        """Whether a wait gave up, from the staged copy (the caller has synchronised past
        `stage_status`); clears the status for the next forward."""
        if not self.status_host[0]:
            return False
        self.status.zero_()
        self.status_host.zero_()
        return True

    def timed_out(self) -> bool:
        """Whether a wait gave up since the last call (synchronises with the current stream)."""
        self.stage_status()
        if self.status.is_cuda:
            torch.cuda.current_stream(self.status.device).synchronize()
        return self.staged_timed_out()


@dataclass(frozen=True)
class LayerWait:
    """What a forward waits for: `flags` reaching the epoch in `expected` (a device scalar: a graph's
    staged input, or flags.expected eagerly). Called with a layer it enqueues the wait kernel;
    `kernel_args(layer)` hands the same wait to a kernel that spins on it itself (the paged
    decode attention, kernels/decode_attention.py: one kernel less per layer)."""
    flags: LayerFlags
    expected: torch.Tensor

    def __call__(self, layer: int) -> None:
        self.flags.wait(layer, self.expected)

    def kernel_args(self, layer: int) -> tuple:
        f = self.flags
        return f.flags, self.expected, f.status, layer, f.max_spins

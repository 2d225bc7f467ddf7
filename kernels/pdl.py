"""Programmatic dependent launch (PDL, Hopper and later): a kernel may start while the one before it
in the stream is still draining.

A small forward is ~330 kernels (kernels/skinny_gemm.py, fused_ops.py, decode_attention.py); each
one, launched the ordinary way, starts only once the one before has finished, and then pays its own
ramp-up: scheduling its programs, the first loads' HBM latency. Launched with PDL, a kernel's
programs are scheduled as soon as every program of the one before has signalled
(`gdc_launch_dependents`, which our kernels do right after their own wait), and block in
`gdc_wait` until the kernel before has finished and its writes are visible: the launch and the
programs' set-up overlap the kernel before's drain. So at most two kernels overlap, and the rule
for every kernel launched this way is: nothing before `gdc_wait` may read or write what a kernel
before it writes or reads. Prefetching a projection's weights into L2 before the wait was measured
and dropped (slower the more it fetched; docs/benchmarks.md, sessions 7 and 11), and so was the
projection before it prefetching them once its own stores were done, over the small kernels
between (0.16 ms slower a forward for o_proj's 33.5 MB a layer, evict-first streams or not; session 33).

Where an early program is placed matters: it takes an SM that has room for it, and that may be an
SM still running the kernel before. A weight-streaming kernel after another should not fit beside
one of its programs: a whole-K down projection at 122 KiB of shared memory, after gate_up's 80 KiB
programs, made a 36-layer chain 0.36 ms slower than at 168 KiB (docs/benchmarks.md, session 16).
The skinny projections' stage counts (kernels/skinny_gemm.py) keep to that. For the same kind of
reason a multi-row tail's attention was launched the ordinary way in sessions 25-27; `spread`
(below) now keeps its programs one an SM instead (kernels/decode_attention.py).

Kernels take `PDL: tl.constexpr` and their wrappers launch with `**launch_kwargs(device)`; with PDL
off (the CPU and its interpreter, GPUs before sm_90, `HICACHE_PDL=0`, or `set_enabled(False)`
before a model's graphs are captured) both are no-ops and the launch is the ordinary one.

`spread(kernel, device)` is the placement rule made explicit for a kernel of one wave whose
programs each run a long loop (the paged attention's split kernel): its compiled kernel asks for
more than half an SM's shared memory, so that no SM takes two of its programs. A 16-row tail's
split kernel (64 KiB, three programs an SM) launched with PDL made the tail forward 0.05-0.2 ms
slower than the ordinary launch; the same launch asking for 128 KiB is 0.04 ms faster than the
ordinary one at 350-8,000 keys, 100 KiB (two an SM) as slow as 64 (H200, 8B, session 28,
docs/benchmarks.md). Without PDL the extra shared memory changes nothing: an ordinary launch
starts on an idle GPU and spreads its programs anyway.
"""
from __future__ import annotations

import functools
import os
import weakref

import torch

_enabled = os.environ.get("HICACHE_PDL", "1") != "0"


def set_enabled(on: bool) -> bool:
    """Switch PDL for launches from now on (CUDA graphs keep what they captured); returns the
    previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    try:
        import triton.language.extra.cuda as triton_cuda
    except ImportError:  # pragma: no cover - no Triton
        return False
    return hasattr(triton_cuda, "gdc_wait") and torch.cuda.get_device_capability(device_index)[0] >= 9  # Triton >= 3.4


def enabled(device: torch.device) -> bool:
    """Whether kernels launched for `device` now use PDL."""
    return _enabled and device.type == "cuda" and _supported(device.index if device.index is not None
                                                             else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict:
    """Keyword arguments for a Triton launch whose kernel takes `PDL: tl.constexpr`: the constexpr
    and, where PDL is on, the launch attribute."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


# compiled kernels spread (Triton keeps them for the process) -> the shared bytes they were compiled with
_spread: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=None)
def _spread_bytes(device_index: int) -> int | None:
    """Shared memory a program asks for so that at most one fits an SM (16 KiB steps above half an
    SM's: 128 KiB on the H200's 228), or None where one block may not have that much."""
    props = torch.cuda.get_device_properties(device_index)
    want = (props.shared_memory_per_multiprocessor // 2 // (16 << 10) + 1) * (16 << 10)
    return want if want <= props.shared_memory_per_block_optin else None


def ask_shared(kernel, shared_bytes: int) -> bool:
    """Launch the compiled Triton `kernel` from now on with `shared_bytes` of shared memory (CUDA
    graphs keep what they captured). Reaches into Triton's compiled kernel: its metadata's `shared`,
    the packed launch metadata, and the module, loaded again so its function may take that much
    (the old module stays loaded: a launch already queued, or a captured graph, may still use it).
    Where that is not as expected the kernel is left as it was and this returns False."""
    metadata, packed = kernel.metadata, kernel.packed_metadata
    try:
        from triton.compiler.compiler import make_backend

        kernel.metadata = metadata._replace(shared=shared_bytes)
        kernel.packed_metadata = make_backend(kernel.metadata.target).pack_metadata(kernel.metadata)
        kernel.module, kernel._run = None, None
        kernel._init_handles()
    except Exception:  # noqa: BLE001 - another Triton's internals: launch as compiled
        kernel.metadata, kernel.packed_metadata = metadata, packed
        return False
    return True


def spread(kernel, device: torch.device, want_bytes: int | None = None) -> bool:
    """Make the compiled Triton `kernel` (what `fn[grid](...)` returns) ask for `want_bytes` of
    shared memory (default: more than half an SM's), so that no SM runs two of its programs, from
    its next launch on. Returns whether its launches now ask for at least that much."""
    if want_bytes is None:
        want_bytes = _spread_bytes(device.index if device.index is not None else torch.cuda.current_device())
    if want_bytes is None:
        return False
    if kernel in _spread or kernel.metadata.shared >= want_bytes:
        return True
    compiled_bytes = kernel.metadata.shared
    if not ask_shared(kernel, want_bytes):
        return False
    _spread[kernel] = compiled_bytes
    return True

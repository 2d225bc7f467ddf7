"""Pick the gather/scatter backend per direction (DESIGN.md section 5).

requested="torch"  -> torch for both, no checks.
requested="triton" -> verify Triton against torch on a scratch pool; any failure raises RuntimeError.
requested="auto"   -> on CUDA: verify, then time Triton vs torch per direction on the real geometry
                      (sampled pool pages, CUDA-event timing after a warm-up); Triton wins gather if
                      t_triton <= 1.05 * t_torch, scatter if <= 1.02 * t_torch. Any Triton failure
                      falls back to torch and says so in `reason`. Without CUDA: torch, no timing
                      (the interpreter exists for tests, not speed).
Timing the scatter writes back into the sampled pages exactly the bytes just gathered from them, so
the pool's contents are unchanged (run it before serving starts).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kernels import page_copy

GATHER_TOLERANCE = 1.05   # triton may be up to 5% slower and still win gather
SCATTER_TOLERANCE = 1.02
_SAMPLE_TARGET_BYTES = 64 << 20  # default sample size: ~64 MiB of pages
_VERIFY_POOL_PAGES = 5


@dataclass(frozen=True)
class ChosenBackends:
    gather: str
    scatter: str
    timings_us: dict = field(default_factory=dict)  # e.g. {"gather_triton": 270.0, "gather_torch": ...}
    reason: str = ""


def _timing_enabled(l1: torch.Tensor) -> bool:
    """Auto mode times only on CUDA (a seam tests monkeypatch to exercise the timed path on CPU)."""
    return l1.is_cuda


def _time_us(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Mean microseconds per call after a warm-up; CUDA events on GPU, perf_counter elsewhere."""
    fn()
    fn()  # warm-up: compile / autotune caches, first-touch
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / repeats  # ms -> us
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) * 1e6 / repeats


def _random_bytes(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  gen: torch.Generator) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.to(device).view(dtype).view(shape)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def verify_triton(l1: torch.Tensor) -> None:
    """Run a tiny Triton gather + scatter on a scratch pool shaped like l1; raise on any failure."""
    if not page_copy.triton_available():
        raise RuntimeError("triton unavailable: no CUDA and TRITON_INTERPRET=1 not set before import")
    _, num_layers, _, s, h, d = l1.shape
    gen = torch.Generator().manual_seed(0)
    shape = (2, num_layers, _VERIFY_POOL_PAGES, s, h, d)
    pool = _random_bytes(shape, l1.dtype, l1.device, gen)         # [2, L, 5, S, H, D]
    page_ids = torch.tensor([3, 0, 4], dtype=torch.int64, device=l1.device)
    n = page_ids.numel()
    packed_ref = torch.empty((n, 2, num_layers, s, h, d), dtype=l1.dtype, device=l1.device)
    packed_tri = torch.empty_like(packed_ref)
    page_copy.gather_pages_torch(pool, page_ids, packed_ref)
    page_copy.gather_pages_triton(pool, page_ids, packed_tri)
    if not _bytes_equal(packed_ref, packed_tri):
        raise RuntimeError("triton gather disagrees with the torch reference")
    pool_ref = torch.zeros_like(pool)
    pool_tri = torch.zeros_like(pool)
    page_copy.scatter_pages_torch(packed_ref, page_ids, pool_ref)
    page_copy.scatter_pages_triton(packed_ref, page_ids, pool_tri)
    if not _bytes_equal(pool_ref, pool_tri):
        raise RuntimeError("triton scatter disagrees with the torch reference")


def _default_sample_pages(l1: torch.Tensor) -> int:
    bytes_per_page = l1[:, :, 0].numel() * l1.element_size()
    return max(1, min(l1.shape[2], _SAMPLE_TARGET_BYTES // bytes_per_page))


def _time_directions(l1: torch.Tensor, num_pages: int, repeats: int) -> dict[str, float]:
    """Time gather and scatter, both backends, on num_pages random pages of the real pool."""
    gen = torch.Generator().manual_seed(1234)
    page_ids = torch.randperm(l1.shape[2], generator=gen)[:num_pages].to(l1.device)  # [n] int64
    _, num_layers, _, s, h, d = l1.shape
    packed = torch.empty((num_pages, 2, num_layers, s, h, d), dtype=l1.dtype, device=l1.device)
    page_copy.gather_pages_torch(l1, page_ids, packed)  # packed holds the pages' current bytes
    return {
        "gather_triton": _time_us(lambda: page_copy.gather_pages_triton(l1, page_ids, packed),
                                  l1.device, repeats),
        "gather_torch": _time_us(lambda: page_copy.gather_pages_torch(l1, page_ids, packed),
                                 l1.device, repeats),
        # scatter writes back the bytes just gathered from the same pages: l1 is unchanged
        "scatter_triton": _time_us(lambda: page_copy.scatter_pages_triton(packed, page_ids, l1),
                                   l1.device, repeats),
        "scatter_torch": _time_us(lambda: page_copy.scatter_pages_torch(packed, page_ids, l1),
                                  l1.device, repeats),
    }


def choose_backends(l1: torch.Tensor, requested: str, num_pages_sample: int | None = None,
                    repeats: int = 10) -> ChosenBackends:
    """Choose gather/scatter backends for pool l1 ([2, L, P, S, H, D]); see the module doc."""
    if requested == "torch":
        return ChosenBackends("torch", "torch", {}, "requested torch")
    if requested == "triton":
        try:
            verify_triton(l1)
        except Exception as exc:
            raise RuntimeError(f"requested backend 'triton' failed verification: {exc!r}") from exc
        return ChosenBackends("triton", "triton", {}, "requested triton (verified against torch)")
    if requested != "auto":
        raise ValueError(f"requested backend must be 'auto', 'triton' or 'torch', got {requested!r}")
    if not _timing_enabled(l1):
        return ChosenBackends("torch", "torch", {}, f"auto: no CUDA ({l1.device}), torch without timing")
    try:
        verify_triton(l1)
        num_pages = num_pages_sample or _default_sample_pages(l1)
        timings = _time_directions(l1, min(num_pages, l1.shape[2]), repeats)
    except Exception as exc:
        return ChosenBackends("torch", "torch", {}, f"auto: triton failed ({exc!r}); fell back to torch")
    gather = "triton" if timings["gather_triton"] <= GATHER_TOLERANCE * timings["gather_torch"] else "torch"
    scatter = "triton" if timings["scatter_triton"] <= SCATTER_TOLERANCE * timings["scatter_torch"] else "torch"
    reason = (f"auto: gather triton {timings['gather_triton']:.1f}us vs torch {timings['gather_torch']:.1f}us "
              f"(tol {GATHER_TOLERANCE}) -> {gather}; scatter triton {timings['scatter_triton']:.1f}us vs "
              f"torch {timings['scatter_torch']:.1f}us (tol {SCATTER_TOLERANCE}) -> {scatter}")
    return ChosenBackends(gather, scatter, timings, reason)

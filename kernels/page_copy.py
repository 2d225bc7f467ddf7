"""Page gather/scatter between the L1 pool and a packed page-major buffer (DESIGN.md sections 3, 5).

Layouts (see hicache/geometry.py):
  l1:       [2 (K/V), L, P, S, H, D]  contiguous; P = pool_pages
  packed:   [n, 2, L, S, H, D]        contiguous (may be buf[:n] of a larger contiguous buffer)
  page_ids: [n] int64 on l1's device; packed[i] <-> l1[:, :, page_ids[i]]

Index math shared by gather and scatter (all int64; an 8B-shaped 30k-token transfer passes 2^31):
  packed row    r = logical_page * 2L + layer_kv        (layer_kv = kv * L + layer)
  packed offset   = r * slab_elements + inner            (slab_elements = S*H*D)
  l1 offset       = (layer_kv * pool_pages + page_ids[logical_page]) * slab_elements + inner

The Triton kernel runs a 2-D grid: axis 0 over tiles of ROWS packed rows (page-id lookup once per
row), axis 1 over BLOCK-element chunks of a slab, so the inner copy is contiguous on both sides and
vectorises; no per-element div/mod. Bytes are copied as same-width integers (dtype-agnostic, exact).
Page ids out of range are the caller's contract: we check shapes/dtypes only, never sync the GPU.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from kernels.direct_launch import DirectLaunch

try:  # triton is optional at import time: the torch backend must work without it
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

BACKENDS = ("triton", "torch")
_TILE_ELEMENTS = 4096  # elements copied per program (ROWS * BLOCK), 8 KiB in bf16
_MAX_BLOCK = 1024  # H200 bench: 1024 >= 4096 for 16-token pages; 4096-elem tiles, 4 warps
_NUM_WARPS = 4
_MAX_GRID_AXIS1 = 65535
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ----------------------------------------------------------------------------- validation

def _check_args(l1: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor) -> int:
    """Validate layouts cheaply (no GPU sync); return n = number of pages moved."""
    if l1.dim() != 6 or l1.shape[0] != 2:
        raise ValueError(f"l1 must be [2, L, P, S, H, D], got shape {tuple(l1.shape)}")
    if page_ids.dim() != 1:
        raise ValueError(f"page_ids must be 1-D, got shape {tuple(page_ids.shape)}")
    if page_ids.dtype != torch.int64:
        raise ValueError(f"page_ids must be int64, got {page_ids.dtype}")
    if not page_ids.is_contiguous():  # (the kernels read it with stride 1: a strided view copied other pages)
        raise ValueError("page_ids must be contiguous")
    if packed.dtype != l1.dtype:
        raise ValueError(f"dtype mismatch: packed {packed.dtype} vs l1 {l1.dtype}")
    n = page_ids.numel()
    _, num_layers, _, s, h, d = l1.shape
    want = (n, 2, num_layers, s, h, d)
    if tuple(packed.shape) != want:
        raise ValueError(f"packed must have shape {want} (page-major, n=len(page_ids)), got {tuple(packed.shape)}")
    if page_ids.device != l1.device or packed.device != l1.device:
        raise ValueError(
            f"device mismatch: l1 {l1.device}, packed {packed.device}, page_ids {page_ids.device}")
    if not l1.is_contiguous() or not packed.is_contiguous():
        raise ValueError("l1 and packed must be contiguous")
    return n


# ----------------------------------------------------------------------------- index math (torch)

def packed_to_l1_offsets(packed_offsets: torch.Tensor, page_ids: torch.Tensor, num_layers: int,
                         pool_pages: int, slab_elements: int) -> torch.Tensor:
    """Map flat element offsets of the packed buffer to flat element offsets of l1 (int64).

    Pure stride arithmetic, the same math as the Triton kernel; lets tests check offsets past 2^31
    without allocating that memory. packed_offsets: [m] int64, page_ids: [n] -> [m] int64.
    """
    offs = packed_offsets.to(torch.int64)
    ids = page_ids.to(device=offs.device, dtype=torch.int64)
    two_l = 2 * num_layers
    rows = offs // slab_elements                      # packed row = logical_page * 2L + layer_kv
    inner = offs - rows * slab_elements
    logical_page = rows // two_l
    layer_kv = rows - logical_page * two_l
    physical_page = ids[logical_page]
    return (layer_kv * pool_pages + physical_page) * slab_elements + inner


# ----------------------------------------------------------------------------- torch reference

def gather_pages_torch(l1: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """packed[i] = l1[:, :, page_ids[i]]  (one strided index_select straight into packed)."""
    if _check_args(l1, page_ids, packed) == 0:
        return
    # l1 viewed page-first: [P, 2, L, S, H, D] (strided) -> packed [n, 2, L, S, H, D]
    torch.index_select(l1.permute(2, 0, 1, 3, 4, 5), 0, page_ids, out=packed)


def scatter_pages_torch(packed: torch.Tensor, page_ids: torch.Tensor, l1: torch.Tensor) -> None:
    """l1[:, :, page_ids[i]] = packed[i]  (index_copy_ into a page-first view of l1)."""
    if _check_args(l1, page_ids, packed) == 0:
        return
    l1.permute(2, 0, 1, 3, 4, 5).index_copy_(0, page_ids, packed)


# ----------------------------------------------------------------------------- triton kernel

if triton is not None:

    # no specialisation on the chunk's length, the pool's size or the index slice's alignment: a
    # transfer chunk of a new length (or starting at an odd page) would otherwise compile a new
    # variant in the middle of serving (~0.1 s: the L3 outlier of session 3 stress run 5)
    @triton.jit(do_not_specialize=["page_ids_ptr", "num_rows", "pool_pages"])
    def _page_copy_kernel(l1_ptr, packed_ptr, page_ids_ptr, num_rows, pool_pages,
                          TWO_L: tl.constexpr, SLAB: tl.constexpr, BLOCK: tl.constexpr,
                          ROWS: tl.constexpr, EVEN: tl.constexpr, GATHER: tl.constexpr):
        # grid = (cdiv(num_rows, ROWS), cdiv(SLAB, BLOCK)); num_rows = n * 2L
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)  # [ROWS]
        row_ok = rows < num_rows
        logical_page = rows // TWO_L                     # once per row, not per element
        layer_kv = rows - logical_page * TWO_L
        physical_page = tl.load(page_ids_ptr + logical_page, mask=row_ok, other=0).to(tl.int64)
        l1_row = (layer_kv * pool_pages + physical_page) * SLAB  # [ROWS] int64
        packed_row = rows * SLAB                                  # [ROWS] int64
        inner = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK]
        if EVEN:
            mask = tl.broadcast_to(row_ok[:, None], (ROWS, BLOCK))
        else:
            mask = row_ok[:, None] & (inner < SLAB)[None, :]
        l1_offs = l1_row[:, None] + inner[None, :]                # [ROWS, BLOCK]
        packed_offs = packed_row[:, None] + inner[None, :]
        if GATHER:
            vals = tl.load(l1_ptr + l1_offs, mask=mask)
            tl.store(packed_ptr + packed_offs, vals, mask=mask)
        else:
            vals = tl.load(packed_ptr + packed_offs, mask=mask)
            tl.store(l1_ptr + l1_offs, vals, mask=mask)
else:  # pragma: no cover
    _page_copy_kernel = None


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=1)
def _direct_launch() -> DirectLaunch:
    """_page_copy_kernel's launches on a given stream (CUDA transfer pipelines)."""
    return DirectLaunch(_page_copy_kernel)


def _launch(l1: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor, gather: bool,
            stream: torch.cuda.Stream | None = None) -> None:
    n = _check_args(l1, page_ids, packed)
    if _page_copy_kernel is None:
        raise RuntimeError("triton is not importable")
    if n == 0:
        return
    _, num_layers, pool_pages, s, h, d = l1.shape
    slab_elements = s * h * d
    word = _WORD_DTYPES[l1.element_size()]  # copy raw words: exact for any dtype (bf16, fp8, ...)
    l1_words, packed_words = l1.view(word), packed.view(word)
    block = min(_next_pow2(slab_elements), _MAX_BLOCK)
    rows_per_prog = max(1, _TILE_ELEMENTS // block)
    num_rows = n * 2 * num_layers
    grid = (triton.cdiv(num_rows, rows_per_prog), triton.cdiv(slab_elements, block))
    if grid[1] > _MAX_GRID_AXIS1:
        raise ValueError(f"slab of {slab_elements} elements is too large for one page copy grid")
    meta = dict(TWO_L=2 * num_layers, SLAB=slab_elements, BLOCK=block, ROWS=rows_per_prog,
                EVEN=(slab_elements % block == 0), GATHER=gather, num_warps=_NUM_WARPS)
    if stream is None:
        _page_copy_kernel[grid](l1_words, packed_words, page_ids, num_rows, pool_pages, **meta)
        return
    _direct_launch()(grid, stream, l1_words, packed_words, page_ids, num_rows, pool_pages, **meta)


def gather_pages_triton(l1: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor,
                        stream: torch.cuda.Stream | None = None) -> None:
    """packed[i] = l1[:, :, page_ids[i]] with one Triton launch (on `stream`, else the current one)."""
    _launch(l1, page_ids, packed, gather=True, stream=stream)


def scatter_pages_triton(packed: torch.Tensor, page_ids: torch.Tensor, l1: torch.Tensor,
                         stream: torch.cuda.Stream | None = None) -> None:
    """l1[:, :, page_ids[i]] = packed[i] with one Triton launch (on `stream`, else the current one)."""
    _launch(l1, page_ids, packed, gather=False, stream=stream)


# ----------------------------------------------------------------------------- dispatch

def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def gather_pages(l1: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor, backend: str,
                 stream: torch.cuda.Stream | None = None) -> None:
    """packed[i] = l1[:, :, page_ids[i]] on `stream` (CUDA; None: the current stream)."""
    _check_backend(backend)
    if backend == "triton":
        gather_pages_triton(l1, page_ids, packed, stream)
        return
    with _on(stream):
        gather_pages_torch(l1, page_ids, packed)


def scatter_pages(packed: torch.Tensor, page_ids: torch.Tensor, l1: torch.Tensor, backend: str,
                  stream: torch.cuda.Stream | None = None) -> None:
    """l1[:, :, page_ids[i]] = packed[i] on `stream` (CUDA; None: the current stream)."""
    _check_backend(backend)
    if backend == "triton":
        scatter_pages_triton(packed, page_ids, l1, stream)
        return
    with _on(stream):
        scatter_pages_torch(packed, page_ids, l1)


def _on(stream: torch.cuda.Stream | None):
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def triton_available() -> bool:
    """True when triton imports and kernels can run: on CUDA, or in interpreter mode (CPU tests).

    The interpreter is chosen when the kernel is decorated, so TRITON_INTERPRET=1 must be set
    before this module is imported; we check the kernel object itself, not only the variable.
    """
    if _page_copy_kernel is None:
        return False
    if torch.cuda.is_available():
        return True
    interpreted = type(_page_copy_kernel).__name__ == "InterpretedFunction"
    return interpreted and os.environ.get("TRITON_INTERPRET", "0") == "1"

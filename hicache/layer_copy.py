"""Layer-ordered L2 -> L1 copies: layer 0's K/V of every page lands first, then layer 1's, and so on,
each layer followed by its flag (kernels/layer_flags.py), so a forward over the restored prefix can
run layer l as soon as layer l has landed instead of after the whole prefix.

L2 is page-major ([page, 2, layer, S, H, D]): the K (or V) slab of layer l of a page is `slab_bytes`
at offset (kv * L + l) * slab_bytes inside that page. L1 is [2, layer, page, S, H, D]: for pages
consecutive in L1, slab (kv, l) of those pages is one contiguous run. So for a run of pages that is
consecutive in both tiers, one layer's K (or V) of the whole run is a single 2-D DMA:

    height = pages in the run, width = slab_bytes,
    source pitch = bytes_per_page (one row per L2 page), destination pitch = slab_bytes (packed).

A restore of one run is 2 DMAs per layer; more fragmented page lists take the copy kernel
(kernels/host_copy.py), or `TransferEngine.h2d` where that is unavailable, and so do machines
without the 2-D copy (kernels/cuda_rt.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from hicache.geometry import KVGeometry
from hicache.transfer_plan import consecutive_runs

# page lists split in more runs than this take the copy kernel (or, without it, one DMA + one scatter)
MAX_LAYER_RUNS = 8
# A 2-D DMA whose rows (slabs) are narrower than this is slow. Restores of the 8B shape on the H200
# (docs/benchmarks.md, session 17): 32 KiB slabs (16-token pages) move at 0.97-0.98 of the pinned
# copy, 16 KiB ones (8-token pages) at 29-30 GiB/s, 2 KiB ones (one-token pages) at 11-18 GiB/s,
# where the copy kernel (kernels/host_copy.py) moves 38-45 GiB/s. Narrower slabs take the kernel on
# CUDA at any length, and a D2H's first pages are gathered like the rest.
MIN_DMA_ROW_BYTES = 32 << 10
# the largest pitch of a 2-D copy (cudaMemcpy2DAsync returns an error past the device's cudaDevAttrMaxPitch,
# 2^31 - 1 on NVIDIA's GPUs): L1's slab rows are a pool's pages of slabs apart
MAX_DMA_PITCH_BYTES = (1 << 31) - 1


class Copy2D(NamedTuple):
    """One 2-D DMA, its fields in cudaMemcpy2DAsync's order (a restore plans ~70 of them). Offsets
    into the destination and source buffers (absolute addresses where the planner was given base
    addresses): L1 and L2 for a restore (layer_plan), a page-major buffer and L1 for a backup's
    first pages (page_out_copies)."""
    dst_offset_bytes: int
    dst_pitch_bytes: int
    src_offset_bytes: int
    src_pitch_bytes: int
    width_bytes: int        # one slab
    height: int             # rows: pages (layer_plan), slabs (page_out_copies)


def page_runs(l1_pages: list[int], host_pages: list[int],
              max_runs: int | None = None) -> list[tuple[int, int]] | None:
    """[start, end) index ranges over which both page lists go up by one (None: more than max_runs)."""
    return consecutive_runs(l1_pages, host_pages, max_runs=max_runs)


def layer_plan(geometry: KVGeometry, l1_num_pages: int, l1_pages: list[int],
               host_pages: list[int]) -> list[list[Copy2D]] | None:
    """The copies of each layer, in layer order (K runs, then V runs); None when the pages split in
    more than MAX_LAYER_RUNS runs."""
    if len(l1_pages) != len(host_pages) or not l1_pages:
        raise ValueError(f"layer_plan: {len(l1_pages)} L1 pages vs {len(host_pages)} host pages")
    runs = page_runs(l1_pages, host_pages, max_runs=MAX_LAYER_RUNS)
    if runs is None:
        return None
    layers, slab = geometry.num_layers, geometry.slab_elements * geometry.itemsize
    page_bytes = geometry.bytes_per_page
    # per run: (L1 offset of its first page in slab 0, L2 offset of its first page, height)
    bases = [(l1_pages[i0] * slab, host_pages[i0] * page_bytes, i1 - i0) for i0, i1 in runs]
    l1_slab_stride = l1_num_pages * slab  # L1 bytes from slab (kv, l) to the next
    return [[Copy2D(dst + s * l1_slab_stride, slab, src + s * slab, page_bytes, slab, height)
             for s in (layer, layers + layer) for dst, src, height in bases]  # K runs, then V runs
            for layer in range(layers)]


def l1_pitch_fits(geometry: KVGeometry, l1_num_pages: int) -> bool:
    """Whether 2-D DMAs can step from one of L1's slab rows to the next (`layer_plan`, `page_out_copies`): their
    pitch, l1_num_pages slabs, within MAX_DMA_PITCH_BYTES. A large pool of a small model is past it (qwen3-0.6b's
    ~72,000 pages of 16 tokens on the H200: 2.36 GB), where every such copy would fail."""
    return l1_num_pages * geometry.slab_elements * geometry.itemsize <= MAX_DMA_PITCH_BYTES


def page_out_copies(geometry: KVGeometry, l1_num_pages: int, l1_pages: list[int], dst_pages,
                    dst_base: int = 0, src_base: int = 0) -> list[Copy2D]:
    """L1 -> page-major, one 2-D DMA per page: its 2L slabs (K of every layer, then V), each at
    its own L1 slab row (pitch = l1_num_pages * slab_bytes), packed one after another into
    destination page `dst_pages[i]` (pitch = slab_bytes). Offsets are added to the bases (give
    the buffers' addresses for DMAs). A backup's first pages go this way, before any index copy
    or gather kernel (hicache/transfer.py)."""
    if len(l1_pages) != len(dst_pages):
        raise ValueError(f"page_out_copies: {len(l1_pages)} L1 pages vs {len(dst_pages)} destination pages")
    slab, page_bytes = geometry.slab_elements * geometry.itemsize, geometry.bytes_per_page
    rows, pitch = 2 * geometry.num_layers, l1_num_pages * slab
    return [Copy2D(dst_base + dst * page_bytes, slab, src_base + src * slab, pitch, slab, rows)
            for src, dst in zip(l1_pages, dst_pages)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("layer copies need contiguous pools")
    return t.reshape(-1).view(torch.uint8)


def run_layer_cpu(copies: list[Copy2D], l1_kv: torch.Tensor, page_buffer: torch.Tensor) -> None:
    """Execute one layer's copies with strided torch copies (CPU pools; the same plan as the DMAs)."""
    run_copies_cpu(copies, l1_kv, page_buffer)


def run_copies_cpu(copies: list[Copy2D], dst_buffer: torch.Tensor, src_buffer: torch.Tensor) -> None:
    """2-D copies between two contiguous CPU tensors, as cudaMemcpy2DAsync would do them."""
    dst, src = _bytes(dst_buffer), _bytes(src_buffer)
    for c in copies:
        d = dst.as_strided((c.height, c.width_bytes), (c.dst_pitch_bytes, 1), c.dst_offset_bytes)
        d.copy_(src.as_strided((c.height, c.width_bytes), (c.src_pitch_bytes, 1), c.src_offset_bytes))


def run_layer_cuda(copies: list[Copy2D], l1_ptr: int, l2_ptr: int, stream: torch.cuda.Stream) -> None:
    """Enqueue one layer's copies as 2-D DMAs from the pinned L2 buffer (at address l2_ptr) into
    the L1 pool (at l1_ptr) on `stream`."""
    from kernels.cuda_rt import memcpy_2d_async

    memcpy_2d_async([(l1_ptr + dst, dst_pitch, l2_ptr + src, src_pitch, width, height)
                     for dst, dst_pitch, src, src_pitch, width, height in copies], stream)

"""Copy kernels that reach pinned L2 straight over PCIe (the pinned buffer is mapped into the device's
address space): `HostCopy.h2d_layers` moves a restore into L1 pages layer by layer and sets each
layer's flag (kernels/layer_flags.py) as soon as that layer has landed; `HostCopy.d2h_pages` writes
L1 pages into scattered L2 pages (a backup into a fragmented L2). One launch each, whatever the
length or fragmentation of the page list.

Where they are used (hicache/transfer.py): layer-ordered restores of at most
--hicache-kernel-restore-max-tokens (the 2 DMAs + 1 flag write per layer of the 2-D DMA plan cost
the loop 0.65-0.94 ms before the forward may launch; this launch 0.2-0.35 ms, session 26), every
layer-ordered restore whose slabs are narrower than
`MIN_DMA_ROW_BYTES` (hicache/layer_copy.py), and page lists in more runs than the DMA plans take, which used a
CPU gather on the loop thread (7-41 ms for 1,000-8,000 tokens) or a CPU index copy at completion,
at 10-19 GiB/s; the kernels move 44-48 GiB/s. Longer restores keep the copy engine: alone 0.97-0.98
of the pinned copy's bandwidth against the kernel's 0.91-0.92, and no SMs taken from the model,
whose forward beside a restore by this kernel ran ~0.2 ms slower at 350 tokens (H200,
docs/benchmarks.md, sessions 5 and 26).

Work is layer-major: item = (layer, K/V, ROWS pages in a row, chunk of a slab), at most 16 KiB
(a 32 KiB slab is two items of one page; 2 KiB slabs of one-token pages go 8 pages an item);
program p takes items p, p + G, p + 2G, ... so all programs work on layer 0 first, then layer 1,
and so on. After its item is stored a program bumps the layer's count (acq_rel); the program that
brings it to the layer's item count resets it and releases `flags[layer] = epoch`. Stream order on the copy stream keeps
two restores' counts apart.

Layouts: L2 page-major [page, 2, L, S, H, D] (slab (kv, l) of a page at (kv * L + l) * SLAB);
L1 [2, L, page, S, H, D] (slab (kv, l) of page p at ((kv * L + l) * pool_pages + p) * SLAB).
Both are copied as raw words (any dtype).
"""
from __future__ import annotations

import torch

from kernels.direct_launch import DirectLaunch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    triton = None

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
MAX_BLOCK_BYTES = 16 << 10   # one item: at most 16 KiB (a share of a slab, or several small slabs)
MAX_ROWS = 64                # at most this many slabs an item
NUM_WARPS = 4
# programs per launch, on the H200. In the background (backups beside decode, and restores no
# forward runs beside): 16 reached the same 0.91-0.92 of the pinned copy as 32-132 from 1,000
# tokens (8: 0.70-0.80) and slowed a stream of small-M GEMMs beside it the least (+6 % while it
# ran, against +10 % at 32 and +32 % at 132; scripts/bench_layer_copy.py, docs/benchmarks.md
# session 5). A layer-ordered restore runs beside the forward that waits for it, which is done only
# when the copy is: a 16-row tail forward behind a restore by 16 / 32 / 64 programs took 4.79 /
# 4.78 / 4.77 ms of device time at 350 tokens, 5.26 / 5.17 / 5.05 at 1,000 and 7.00 / 6.49 / 6.27
# at 2,000 (4.57 / 4.62 / 4.68 with no copy), but 128 programs, on 132 SMs, 5.46 and 7.23
# (docs/benchmarks.md session 26): at most half the SMs
BACKGROUND_PROGRAMS = 16
BESIDE_FORWARD_PROGRAMS = 64


def beside_forward_programs(sm_count: int | None) -> int:
    """A layer-ordered restore's programs on a GPU of `sm_count` SMs (None: not a GPU):
    BESIDE_FORWARD_PROGRAMS, at most half the SMs."""
    if sm_count is None:
        return BESIDE_FORWARD_PROGRAMS
    return max(1, min(BESIDE_FORWARD_PROGRAMS, sm_count // 2))


if triton is not None:
    @triton.jit(do_not_specialize=["epoch", "num_pages", "pool_pages"])
    def _h2d_layers_kernel(src_ptr, dst_ptr, pages_ptr, counts_ptr, flags_ptr, epoch, num_pages, pool_pages,
                           NUM_LAYERS: tl.constexpr, SLAB: tl.constexpr, BLOCK: tl.constexpr,
                           ROWS: tl.constexpr):
        # pages_ptr: [2, num_pages] int32 (row 0 L2 pages, row 1 L1 pages); an item is chunk `chunk`
        # of slab (kv, layer) of ROWS listed pages in a row: [ROWS, BLOCK] words
        CHUNKS: tl.constexpr = SLAB // BLOCK
        per_kv = tl.cdiv(num_pages, ROWS) * CHUNKS
        per_layer = 2 * per_kv
        rows = tl.arange(0, ROWS)
        offs = tl.arange(0, BLOCK)
        for item in range(tl.program_id(0), NUM_LAYERS * per_layer, tl.num_programs(0)):
            layer = item // per_layer
            rest = item - layer * per_layer
            kv = rest // per_kv
            rest = rest - kv * per_kv
            group = rest // CHUNKS
            chunk = rest - group * CHUNKS
            i = group * ROWS + rows                                             # [ROWS] listed pages
            ok = i < num_pages
            host_page = tl.load(pages_ptr + i, mask=ok, other=0).to(tl.int64)
            l1_page = tl.load(pages_ptr + num_pages + i, mask=ok, other=0).to(tl.int64)
            slab = kv * NUM_LAYERS + layer
            host = (host_page * (2 * NUM_LAYERS) + slab) * SLAB + chunk * BLOCK  # [ROWS] word offsets
            dev = (slab.to(tl.int64) * pool_pages + l1_page) * SLAB + chunk * BLOCK  # (2L - 1) * pool_pages > 2^31
            m = ok[:, None]
            words = tl.load(src_ptr + host[:, None] + offs[None, :], mask=m)    # [ROWS, BLOCK]
            tl.store(dst_ptr + dev[:, None] + offs[None, :], words, mask=m)
            tl.debug_barrier()  # every thread's stores precede the release below
            done = tl.atomic_add(counts_ptr + layer, 1, sem="acq_rel")
            if done == per_layer - 1:  # the layer's last item: reset the count, publish the flag
                tl.store(counts_ptr + layer, 0)
                tl.atomic_xchg(flags_ptr + layer, epoch, sem="release")

    @triton.jit(do_not_specialize=["num_pages", "pool_pages"])
    def _d2h_pages_kernel(src_ptr, dst_ptr, pages_ptr, num_pages, pool_pages,
                          NUM_LAYERS: tl.constexpr, SLAB: tl.constexpr, BLOCK: tl.constexpr,
                          ROWS: tl.constexpr):
        # pages_ptr: [2, num_pages] int32 (row 0 L2 pages, row 1 L1 pages); page-major items (chunk
        # `chunk` of ROWS slabs in a row of one page), so each L2 page is written front to back
        CHUNKS: tl.constexpr = SLAB // BLOCK
        TWO_L: tl.constexpr = 2 * NUM_LAYERS
        per_page = tl.cdiv(TWO_L, ROWS) * CHUNKS
        rows = tl.arange(0, ROWS)
        offs = tl.arange(0, BLOCK)
        for item in range(tl.program_id(0), num_pages * per_page, tl.num_programs(0)):
            i = item // per_page
            rest = item - i * per_page
            group = rest // CHUNKS
            chunk = rest - group * CHUNKS
            slab = group * ROWS + rows                                          # [ROWS] slabs of page i
            ok = slab < TWO_L
            host_page = tl.load(pages_ptr + i).to(tl.int64)
            l1_page = tl.load(pages_ptr + num_pages + i).to(tl.int64)
            host = (host_page * TWO_L + slab) * SLAB + chunk * BLOCK             # [ROWS] word offsets
            dev = (slab.to(tl.int64) * pool_pages + l1_page) * SLAB + chunk * BLOCK
            m = ok[:, None]
            words = tl.load(src_ptr + dev[:, None] + offs[None, :], mask=m)     # [ROWS, BLOCK]
            tl.store(dst_ptr + host[:, None] + offs[None, :], words, mask=m)
else:  # pragma: no cover
    _h2d_layers_kernel = _d2h_pages_kernel = None


def plan_words(slab_bytes: int) -> tuple[torch.dtype, int, int, int]:
    """(word dtype, words per slab, words per chunk, chunks per item): the widest word that divides
    a slab, the largest power-of-two share of the slab up to MAX_BLOCK_BYTES, and as many such chunks
    of slabs in a row (a power of two) as fit in MAX_BLOCK_BYTES. Small slabs (one-token pages:
    2 KiB of the 8B shape) move 8 at a time: an item's wait over PCIe and its count's atomic are
    then spread over 16 KiB, as with the 16-token pages' slabs (one 2 KiB slab an item moved a
    350-token restore at 8 GiB/s on the H200, docs/benchmarks.md session 17)."""
    word = next(w for w in _WORDS if slab_bytes % w.itemsize == 0)
    slab_words = slab_bytes // word.itemsize
    block = slab_words & -slab_words  # largest power of two dividing it
    while block * word.itemsize > MAX_BLOCK_BYTES:
        block //= 2
    rows = 1
    while 2 * rows * block * word.itemsize <= MAX_BLOCK_BYTES and rows < MAX_ROWS:
        rows *= 2
    return word, slab_words, block, rows


def _flat_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("host_copy needs contiguous pools")
    return t.reshape(-1).view(torch.uint8).view(word)


class HostCopy:
    """The copy kernels bound to one L1 pool and one L2 page buffer: shapes checked, word views and
    item size worked out once (a restore's launch then does no more than the launch).

    page_buffer: [P2, 2, L, S, H, D] pinned host (or any memory the device can read);
    l1_kv: [2, L, P1, S, H, D] on the device; `pages` arguments: [2, n] int32 on the device
    (row 0 L2 pages, row 1 L1 pages)."""

    def __init__(self, page_buffer: torch.Tensor, l1_kv: torch.Tensor, programs: int | None = None) -> None:
        """programs: per launch for every use (tests, benchmarks); default BACKGROUND_PROGRAMS, and
        `beside_forward_programs` for a restore a forward waits for."""
        if _h2d_layers_kernel is None:
            raise RuntimeError("triton is not importable")
        if page_buffer.shape[1:] != (2,) + tuple(l1_kv.shape[1:2]) + tuple(l1_kv.shape[3:]):
            raise ValueError(f"L2 page shape {tuple(page_buffer.shape[1:])} does not match L1 {tuple(l1_kv.shape)}")
        word, slab_words, block, rows = plan_words(l1_kv[0, 0, 0].numel() * l1_kv.element_size())
        self.host, self.dev = _flat_words(page_buffer, word), _flat_words(l1_kv, word)
        self.num_layers, self.pool_pages = l1_kv.shape[1], l1_kv.shape[2]
        self.chunks_per_page = 2 * self.num_layers * (slab_words // block)
        self.rows = rows
        if programs is not None and programs < 1:
            raise ValueError(f"programs must be >= 1, got {programs}")
        sms = torch.cuda.get_device_properties(l1_kv.device).multi_processor_count if l1_kv.is_cuda else None
        self.programs = {"background": programs or BACKGROUND_PROGRAMS,
                         "beside_forward": programs or beside_forward_programs(sms)}
        self._direct: dict = {}  # kernel -> DirectLaunch, for launches on a given stream (CUDA)
        self._meta = dict(NUM_LAYERS=self.num_layers, SLAB=slab_words, BLOCK=block, ROWS=rows, num_warps=NUM_WARPS)

    def _grid(self, pages: torch.Tensor, use: str) -> tuple[int, ...]:
        if pages.dim() != 2 or pages.shape[0] != 2 or pages.dtype != torch.int32:
            raise ValueError(f"pages must be [2, n] int32, got {tuple(pages.shape)} {pages.dtype}")
        if not pages.is_contiguous():  # (the kernels read it with fixed strides: a transposed view copied others)
            raise ValueError("pages must be contiguous")
        items = -(-pages.shape[1] * self.chunks_per_page // self.rows)  # about: rows group pages or slabs
        return (max(1, min(self.programs[use], items)),)

    def h2d_layers(self, pages: torch.Tensor, counts: torch.Tensor, flags: torch.Tensor, epoch: int,
                   stream: torch.cuda.Stream | None = None, beside_forward: bool = True) -> None:
        """Copy every layer of the listed pages from L2 into L1 on `stream` (None: the current one)
        and set flags[l] = epoch behind layer l (counts: [L] int32 zeros, owned by that stream).
        beside_forward: a forward waits for these flags as they come (more programs); False: nothing
        runs beside it but other requests' work (BACKGROUND_PROGRAMS)."""
        grid = self._grid(pages, "beside_forward" if beside_forward else "background")
        if pages.shape[1]:
            self._run(_h2d_layers_kernel, grid, stream, self.host, self.dev, pages, counts, flags, epoch,
                      pages.shape[1], self.pool_pages)

    def d2h_pages(self, pages: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        """Write the listed L1 pages into their L2 pages (written over PCIe) on `stream` (None: the
        current one): no gather into a workspace, no CPU copy into fragmented L2 pages."""
        grid = self._grid(pages, "background")
        if pages.shape[1]:
            self._run(_d2h_pages_kernel, grid, stream, self.dev, self.host, pages, pages.shape[1], self.pool_pages)

    def _run(self, kernel, grid: tuple[int, ...], stream: torch.cuda.Stream | None, *args) -> None:
        if stream is None:
            kernel[grid](*args, **self._meta)
            return
        if kernel not in self._direct:
            self._direct[kernel] = DirectLaunch(kernel)
        self._direct[kernel](grid, stream, *args, **self._meta)

    def warm_up(self, counts: torch.Tensor, flags: torch.Tensor) -> None:
        """Compile both kernels now (launches over zero pages: nothing is read or written), not in
        the middle of serving the first transfer that needs them."""
        pages = torch.zeros((2, 1), dtype=torch.int32, device=self.dev.device)
        _h2d_layers_kernel[(1,)](self.host, self.dev, pages, counts, flags, 0, 0, self.pool_pages, **self._meta)
        _d2h_pages_kernel[(1,)](self.dev, self.host, pages, 0, self.pool_pages, **self._meta)

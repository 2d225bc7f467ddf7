"""How a transfer is cut up, as pure functions of page lists and sizes (hicache/transfer.py runs
the plans): consecutive runs of L2 pages, and the chunks of the CUDA gather/scatter + DMA pipeline."""
from __future__ import annotations


# L2 destinations split in at most this many consecutive runs move with one DMA per run; more
# fragmented ones (either direction) go by the copy kernels (kernels/host_copy.py), or, without
# them, through a pinned workspace with a CPU gather (H2D) or index copy (D2H).
MAX_DMA_RUNS = 8

# The gather/scatter + DMA pipeline's chunks (`ramp_chunks`). Only the first gather of a D2H (the
# last scatter of an H2D) is exposed, so the first chunk is small: 8 MiB is ~0.14 ms of DMA on the
# H200, longer than the loop takes to enqueue the next chunk. A kernel moves pages ~30x faster than
# PCIe, so each later chunk may be 16x the one before and its kernel still ends under the DMA before
# it: an 8,000-token H2D of the 8B shape (2.25 MiB pages) is chunks of 3, 48 and 449 pages, a
# D2H 3 direct pages then 6, 96 and 395 (fixed 32 MiB chunks had made it 36 chunks, each costing
# the loop ~0.1 ms to enqueue).
RAMP_FIRST_BYTES = 8 << 20
RAMP_GROWTH = 16
# A D2H's first pages skip the gather: one 2-D DMA per page straight out of L1 (its 2L slabs,
# layer_copy.page_out_copies), enqueued before the page-index copy and the first gather kernel, so
# the copy engine starts ~0.1 ms sooner; the gather of the rest runs under them. Few pages: each
# is one more DMA of 2L rows one L1 slab row apart (slower the larger the L1 pool) and one more
# call on the loop. 8 MiB is 3 pages of the 8B shape: against 7 (16 MiB, sessions 9-11), a
# 1,000-token D2H took 0.983-0.984 of the pinned copy's device time instead of 0.972 in four
# alternations on one H200 lease (a 1,008-page L1), 0.964-0.967 of its wall time instead of
# 0.955-0.958; even at 3,504 and 8,000 tokens (docs/benchmarks.md, session 12).
DIRECT_FIRST_BYTES = 8 << 20
DIRECT_MAX_PAGES = 8


def ramp_chunks(num_pages: int, first_pages: int, growth: int) -> list[int]:
    """Chunk lengths in pages, in a D2H's pipeline order (an H2D runs them reversed), summing to
    num_pages: `first_pages`, then each at most `growth` times the one before (the last takes
    what is left)."""
    if num_pages < 1 or first_pages < 1 or growth < 1:
        raise ValueError(f"ramp_chunks: {num_pages} pages, first {first_pages}, growth {growth}")
    sizes = [min(num_pages, first_pages)]
    left = num_pages - sizes[0]
    while left:
        sizes.append(min(left, sizes[-1] * growth))
        left -= sizes[-1]
    return sizes


def gathered_chunks(num_pages: int, direct_pages: int, first_pages: int) -> list[int]:
    """A D2H's gathered chunks after `direct_pages` went straight out of L1: the first one may be
    twice that (its index copy and gather run under the direct DMAs), then `ramp_chunks` growth; a
    remainder smaller than the first chunk rides with the chunk before it (one launch and one DMA
    fewer; the kernels after the first hide under a DMA many times longer)."""
    sizes = ramp_chunks(num_pages, max(2 * direct_pages, first_pages), RAMP_GROWTH)
    if len(sizes) > 1 and sizes[-1] < sizes[0]:
        last = sizes.pop()
        sizes[-1] += last
    return sizes


def consecutive_runs(pages: list[int], other: list[int] | None = None,
                     max_runs: int | None = None) -> list[tuple[int, int]] | None:
    """[start, end) index ranges over which `pages` (and `other`, of the same length, when given)
    go up by one; None once there are more than `max_runs`: the scan stops there, so a fragmented
    list of one-token pages costs a few steps, not one a page (~2 ms for 8,000 pages on the
    development machine)."""
    n = len(pages)
    breaks = (i for i in range(1, n) if pages[i] != pages[i - 1] + 1 or other[i] != other[i - 1] + 1) \
        if other is not None else (i for i in range(1, n) if pages[i] != pages[i - 1] + 1)
    runs, first = [], 0
    for i in breaks:
        if max_runs is not None and len(runs) + 1 == max_runs:
            return None  # this break makes max_runs + 1 runs
        runs.append((first, i))
        first = i
    runs.append((first, n))
    return runs


def host_runs(pages: list[int], max_runs: int | None = None) -> list[tuple[int, int, int]] | None:
    """Consecutive runs of host pages as (first index, end index, first page); None when there are
    more than `max_runs`."""
    runs = consecutive_runs(pages, max_runs=max_runs)
    return None if runs is None else [(i0, i1, pages[i0]) for i0, i1 in runs]

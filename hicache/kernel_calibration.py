"""Which short layer-ordered restores the copy kernel takes on this machine, timed once at start.

Layer-ordered L2 -> L1 restores of at most `kernel_restore_max_tokens` go by one copy kernel whose
SMs read pinned L2 over PCIe (kernels/host_copy.py) instead of the 2-D DMA plan (2 DMAs and a flag
write per layer): its launch costs the loop 0.2-0.35 ms before the forward may go, the DMAs'
enqueue 0.65-0.94 (H200, docs/benchmarks.md session 26). Where the kernel reads pinned memory about
as fast as the DMAs, that saving wins: on the H200s and on session 69's H100 (the kernel at
0.86-0.91 of the pinned copy) restores by the kernel beat DMAs-only by 0.3-1.3 ms at 1,000 and 3,500
tokens. But how fast the SMs read mapped host memory is a property of the host: on the H100s of
sessions 61 and 68 the kernel moved only 29-30 GiB/s against the DMAs' 46, and a 3,500-token restore of
the 4B shape took 1.31 x its floor.

So, at start, a restore of `probe_pages` L2 pages into L1 pages (free then) is timed both ways
(host enqueue + device time, the best of a few), and where the kernel's is more than `MARGIN` over
the DMAs', the kernel keeps only the restores short enough that its slower copy costs no more than
the enqueue it saves (`kernel_max_pages`)."""
from __future__ import annotations

from dataclasses import dataclass

import structlog

from hicache.transfer_record import TransferError

log = structlog.get_logger("hicache.kernel_calibration")

PROBE_BYTES = 128 << 20  # about a 1,000-token restore of the 8B shape: long enough to time the rate
REPEATS = 3              # each path's best of this many (after one untimed run)
MARGIN = 0.10            # the kernel is capped only where its restore takes > 1.1 x the DMAs'


@dataclass(frozen=True)
class RestoreTimes:
    """One path's restore of `pages` pages: host time to enqueue it, device time to move it."""
    pages: int
    enqueue_ns: int
    device_ns: int

    @property
    def total_ns(self) -> int:  # (a forward waits for both: it launches after the enqueue, runs behind the copy)
        return self.enqueue_ns + self.device_ns


@dataclass(frozen=True)
class Calibration:
    kernel: RestoreTimes
    dma: RestoreTimes
    configured_pages: int
    kernel_max_pages: int  # what the transfer engine now uses


def kernel_max_pages(kernel: RestoreTimes, dma: RestoreTimes, configured_pages: int) -> int:
    """`configured_pages` unless the kernel's restore took over (1 + MARGIN) x the DMAs' (same pages);
    then the most pages whose extra device time by the kernel (linear in the pages) stays within the
    host time its launch saves over the DMAs' enqueue (0 where it saves none)."""
    if kernel.pages != dma.pages or kernel.pages < 1:
        raise ValueError(f"both paths must time the same pages, got {kernel.pages} and {dma.pages}")
    if kernel.total_ns <= (1 + MARGIN) * dma.total_ns:
        return configured_pages
    saved_ns = dma.enqueue_ns - kernel.enqueue_ns
    if saved_ns <= 0:
        return 0
    extra_ns_per_page = (kernel.device_ns - dma.device_ns) / kernel.pages  # (> 0: its total is the longer)
    return min(configured_pages, int(saved_ns / extra_ns_per_page))


def probe_pages(bytes_per_page: int, configured_pages: int, l1_pages: int, l2_pages: int) -> int:
    """The pages a probe restores: about PROBE_BYTES, within what the kernel would take and both pools hold."""
    return max(0, min(max(1, PROBE_BYTES // bytes_per_page), configured_pages, l1_pages, l2_pages))


def calibrate(transfer, configured_pages: int) -> Calibration | None:
    """Time `transfer`'s (hicache/transfer.py TransferEngine, CUDA) restores of L2 pages 0.. into L1 pages 0..
    by the kernel and by the DMAs, and set its `kernel_max_pages`; None (nothing changed) where it has
    only one path. Run at start, before any page is in use: the probe writes over L1 pages."""
    if not (transfer.cuda and transfer.host_reads and transfer.layerwise) or transfer.narrow_slabs:
        return None
    n = probe_pages(transfer.geometry.bytes_per_page, configured_pages, transfer.l1.num_pages,
                    transfer.l2.num_pages)
    if n < 1:
        return None
    pages = list(range(n))
    kernel = _best(transfer, pages, by_kernel=True)
    dma = _best(transfer, pages, by_kernel=False)
    if kernel is None or dma is None:
        return None
    cal = Calibration(kernel, dma, configured_pages, kernel_max_pages(kernel, dma, configured_pages))
    transfer.kernel_max_pages = cal.kernel_max_pages
    log.info("copy_kernel_calibrated", pages=n, kernel_enqueue_ns=kernel.enqueue_ns, kernel_device_ns=kernel.device_ns,
             dma_enqueue_ns=dma.enqueue_ns, dma_device_ns=dma.device_ns, kernel_max_pages=cal.kernel_max_pages,
             configured_pages=configured_pages)
    return cal


def _best(transfer, pages: list[int], by_kernel: bool) -> RestoreTimes | None:
    """The fastest of REPEATS restores of `pages` by one path (after one untimed); None if one failed or
    could not be made (h2d_layerwise's None). Pages 0..n-1 are one run each side: the DMA plan takes them."""
    configured, faults = transfer.kernel_max_pages, transfer.faults
    transfer.kernel_max_pages = len(pages) if by_kernel else 0
    transfer.faults = None  # (an injected fault is meant for a request's transfer, not this probe)
    try:
        best = None
        for i in range(REPEATS + 1):
            tr = transfer.h2d_layerwise(pages, pages)
            if tr is None:
                return None
            transfer.wait_blocking(tr)
            times = RestoreTimes(len(pages), tr.enqueue_ns, tr.service_ns)
            if i and (best is None or times.total_ns < best.total_ns):
                best = times
        return best
    except TransferError as exc:
        log.warning("copy_kernel_calibration_failed", by_kernel=by_kernel, error=str(exc))
        return None
    finally:
        transfer.kernel_max_pages, transfer.faults = configured, faults

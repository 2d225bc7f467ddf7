"""Device <-> host page transfers: one gather kernel + one DMA (D2H), one DMA + one scatter (H2D).

D2H:  L1 pages --gather kernel--> packed device workspace [n, 2, L, S, H, D]
      --one async DMA--> L2 pages directly when they are consecutive, else a pinned workspace
      followed by one CPU index copy into the L2 pool (at completion, off the loop thread).
      On CUDA the first few pages skip the gather: one 2-D DMA each straight out of L1, enqueued
      before anything else, so the copy engine starts while the rest is being gathered.
H2D:  mirror: (CPU index gather only when L2 pages are fragmented) --one DMA--> device workspace
      --scatter kernel--> arbitrary L1 pages.
H2D, layer-ordered (h2d_layerwise in hicache/transfer_layered.py; plan: hicache/layer_copy.py): 2-D
      DMAs straight into the L1 pages,
      layer by layer, each layer followed by its flag (kernels/layer_flags.py), for a forward that
      runs behind the copy. A restore longer than that forward may first move `whole_pages` of it
      the classic way (one DMA + scatter, pipelined): those land at the pinned copy's rate before
      the forward has work to do, where the 2-D DMAs beside a running forward lose 8-12 % of it.
Fragmented L2 pages (more runs than the DMA plans take), either direction, layer-ordered or not: one
      copy kernel that reaches the pinned L2 pages over PCIe (kernels/host_copy.py) instead of a CPU
      gather (H2D) or a workspace and a CPU index copy at completion (D2H).
Work runs on private CUDA streams, kernels and DMAs one stream each per direction (PCIe is full
duplex: a backup never queues a restore). Kernels, and every DMA that reads L1, first wait on the
caller's stream (the KV being copied is produced there). An H2D's DMAs into a workspace do not
(but for a workspace allocated just now, `ws.fresh`): they write only that workspace, reused only
after its last transfer was seen complete, and read L2 pages locked until completion. The caller's
stream never waits for a transfer: nothing there may touch the destination pages until `wait()`
returns (layer-ordered: until that layer's flag).
Completion is a `Transfer` whose `wait()` awaits the
CUDA event from a worker thread of its direction (`Event.synchronize` releases the GIL), so the loop
never spins and a restore's completion never queues behind backups'.
On the CPU every copy is synchronous and transfers are complete when enqueued. What one transfer
records, and which of its time is its own cost: hicache/transfer_record.py.
On CUDA a transfer of 8 or more pages whose L2 pages form one run (or, without the copy kernels,
are fragmented) is pipelined in chunks that grow (`ramp_chunks`): chunk i's
DMA runs while chunk i+1's gather (D2H) or chunk i-1's scatter (H2D) runs on the SMs. The first DMA
is the first thing enqueued (D2H: the direct pages; H2D: the first chunk, which waits for nothing).
"""
from __future__ import annotations

import asyncio
import functools
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from hicache.faults import Fault, FaultInjector
from hicache.geometry import KVGeometry
from hicache.layer_copy import MIN_DMA_ROW_BYTES, l1_pitch_fits, page_out_copies
from hicache.pools import DevicePool, HostPool
from hicache.transfer_plan import (DIRECT_FIRST_BYTES, DIRECT_MAX_PAGES, MAX_DMA_RUNS, RAMP_FIRST_BYTES,
                                   RAMP_GROWTH, gathered_chunks, host_runs, ramp_chunks)
from hicache.transfer_layered import LayeredRestores
from hicache.transfer_record import Transfer, TransferError
from hicache.workspaces import PageLists, Workspace, Workspaces
from kernels import cuda_rt, host_copy
from kernels.chooser import ChosenBackends
from kernels.layer_flags import EPOCH_LIMIT, LayerFlags
from kernels.page_copy import gather_pages, scatter_pages, triton_available


COMPLETED = object()  # `_completions`' value for a transfer `wait_blocking` completed


class TransferEngine(LayeredRestores):
    def __init__(self, l1: DevicePool, l2: HostPool, backends: ChosenBackends,
                 faults: FaultInjector | None = None, kernel_max_pages: int = 0,
                 min_dma_row_bytes: int | None = None) -> None:
        self.l1, self.l2 = l1, l2
        self.geometry: KVGeometry = l1.geometry
        self.backends = backends
        self.faults = faults
        self.cuda = l1.device.type == "cuda"
        # kernels (gather / scatter) and DMAs each get one stream per direction: PCIe is full
        # duplex, and a backup's D2H must not queue a restore's H2D behind it (streams are in order)
        self.kernel_streams = ({d: torch.cuda.Stream(device=l1.device) for d in ("d2h", "h2d")} if self.cuda
                               else None)
        self.copy_streams = ({d: torch.cuda.Stream(device=l1.device) for d in ("d2h", "h2d")} if self.cuda
                             else None)
        # pipelining: a small first chunk (D2H; the last one for H2D), then chunks growing RAMP_GROWTH
        # times, so the first DMA starts after a few us of gather and every later kernel hides under
        # the DMA before it (ramp_chunks)
        self.first_chunk_pages = max(1, RAMP_FIRST_BYTES // self.geometry.bytes_per_page)
        self.direct_pages = 0  # a D2H's first pages DMA'd straight out of L1 (set below when it can)
        # slabs too narrow for 2-D DMAs, or L1's rows too far apart for one (`l1_pitch_fits`): no direct pages,
        # every layer-ordered restore by the kernel (none without it)
        row_min_bytes = MIN_DMA_ROW_BYTES if min_dma_row_bytes is None else min_dma_row_bytes
        pitch_fits = l1_pitch_fits(self.geometry, l1.num_pages)
        self.narrow_slabs = self.geometry.slab_elements * self.geometry.itemsize < row_min_bytes or not pitch_fits
        self.workspaces = Workspaces(self.geometry, l1.device)
        self.page_lists = PageLists()
        # completions are awaited on worker threads, a pool per direction: a restore's must never
        # queue behind backups' (a busy trace replay had restores waiting ~19 ms each behind them)
        self._waiters = {d: ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"hicache-{d}-wait")
                         for d in ("d2h", "h2d")}
        # each transfer's completion (wait): awaited again, never run again
        self._completions: weakref.WeakKeyDictionary[Transfer, asyncio.Future | object] = weakref.WeakKeyDictionary()
        self._closed = False  # close() shut the waiters down: `wait` then fails a transfer that needs one, "closed"
        # layer-ordered restores (h2d_layerwise) have a copy stream of their own: a forward waits on
        # the device for them (kernels/layer_flags.py) and must not also wait for a parked restore's
        # classic H2D queued ahead of them. Behind each layer's DMAs the stream sets that layer's
        # flag to the restore's epoch.
        self.layer_stream = torch.cuda.Stream(device=l1.device) if self.cuda else None
        # the scatters of a layer-ordered restore's whole pages (h2d_layerwise's whole_pages)
        self.layer_kernel_stream = torch.cuda.Stream(device=l1.device) if self.cuda else None
        # nothing runs on it: an event recorded there fires at once, the enqueue time on the device clock
        self._clock_stream = torch.cuda.Stream(device=l1.device) if self.cuda else None
        self.layer_flags: LayerFlags | None = None
        self.layerwise = not self.cuda
        self._memcpy = None  # cuda_rt.memcpy_async: a pipeline chunk's DMA in one call
        self._memcpy_2d = None  # cuda_rt.memcpy_2d_async: a D2H's direct first pages
        kernel_reads = self.cuda and l2.pinned and triton_available()  # (host_reads, below)
        if self.cuda:
            self.layerwise = cuda_rt.available() and l2.pinned and (pitch_fits or kernel_reads)
            self._memcpy = cuda_rt.memcpy_async if cuda_rt.available() else None
            if cuda_rt.available() and l2.pinned and not self.narrow_slabs:
                self._memcpy_2d = cuda_rt.memcpy_2d_async
                self.direct_pages = min(DIRECT_MAX_PAGES, max(1, DIRECT_FIRST_BYTES // self.geometry.bytes_per_page))
            if self.layerwise:
                self.layer_flags = LayerFlags(self.geometry.num_layers, l1.device)
        # short or fragmented restores, fragmented backups: copy kernels that reach pinned L2 over
        # PCIe. The restore kernel's per-layer counts belong to the stream it runs on (stream order
        # keeps two launches apart); the classic H2D path's flags are its own (only the layer
        # stream writes layer_flags, in epoch order)
        self.host_reads = kernel_reads
        self.kernel_max_pages = kernel_max_pages  # layer-ordered restores this short take the kernel too
        if self.host_reads:
            zeros = functools.partial(torch.zeros, self.geometry.num_layers, dtype=torch.int32, device=l1.device)
            self._counts = {"layer": zeros(), "h2d": zeros()}
            self._h2d_flags = zeros()
            self._h2d_epoch = 0
            self.host_copy = host_copy.HostCopy(l2.page_buffer, l1.kv)
            self.host_copy.warm_up(self._counts["h2d"], self._h2d_flags)

    # -- enqueue -------------------------------------------------------------------------------
    def _index(self, pages: list[int]) -> torch.Tensor:
        # non_blocking: a blocking copy synchronizes the caller's stream, stalling the host behind
        # whatever forward is in flight there. A small pageable async H2D is staged by the driver
        # before the call returns, without a device sync; the transfer streams wait on the
        # caller's stream, which orders the copy
        # (short transfers: their DMA follows this copy. Pipelined ones stage their index with the
        # workspace, _stage_index, since a restore's first DMA goes before its index)
        return torch.from_numpy(np.array(pages, dtype=np.int64)).to(self.l1.device, non_blocking=True)  # [n]

    def d2h(self, l1_pages: list[int], host_pages: list[int]) -> Transfer:
        """L1 -> L2 (gather + DMA, pipelined). Running the layer plan backwards (2-D DMAs straight
        from L1, no gather) was measured and dropped: batch-32 decode beside such backups fell to
        0.82 of hicache off (session 3 run 6), against 0.945-0.969 with this path (docs/benchmarks.md)."""
        return self._enqueue("d2h", l1_pages, host_pages)

    def h2d(self, host_pages: list[int], l1_pages: list[int]) -> Transfer:
        return self._enqueue("h2d", l1_pages, host_pages)

    def _copy_kernel(self, tr: Transfer, stream: torch.cuda.Stream, host_pages: list[int], l1_pages: list[int],
                     flags: LayerFlags | None, launch) -> None:
        """`launch(pages, stream)` of a copy kernel (kernels/host_copy.py), timed by the
        transfer's events; pages [2, n] int32 in pinned memory (`PageLists`), which the kernel
        reads over PCIe as it reads L2. The stream first waits for the caller's (where the L1 pages
        were last read, or the KV being backed up was written). A launch that raises fails the
        transfer, not the caller; `flags` (a layer-ordered restore's) are then all written anyway,
        so no forward waits for them."""
        self._events(tr)
        stream.wait_stream(cuda_rt.current_stream(self.l1.device))
        tr.start_event.record(stream)
        try:
            # (until session 32 the list went by a non-blocking copy on the caller's stream, which
            # this stream then waited for again: 3 more runtime calls before the launch)
            tr.page_list, pages = self.page_lists.acquire(host_pages, l1_pages)  # [2, n], the transfer's until it settles
            launch(pages, stream)
        except Exception as exc:
            tr.fail, tr.error = True, f"{tr.direction}: copy kernel not launched: {exc!r}"
            for layer in range(self.geometry.num_layers if flags is not None else 0):
                flags.signal(stream, layer, tr.epoch)
        tr.event.record(stream)

    def refuse_if_closed(self, direction: str) -> None:
        """A copy whose completion needs a waiter thread (every one on CUDA; a D2H into fragmented L2 pages on the
        CPU), enqueued after close() shut them down, is refused as it is submitted, as a closed L3's read or write
        is: nothing of it enqueued, no workspace taken (regression: the pool's "cannot schedule new futures after
        shutdown" at its wait, counted `transfer`, its workspace kept for good)."""
        if self._closed:
            raise TransferError(f"{direction}: the transfer engine is closed", "closed")

    def _enqueue(self, direction: str, l1_pages: list[int], host_pages: list[int]) -> Transfer:
        if len(l1_pages) != len(host_pages) or not l1_pages:
            raise TransferError(f"{direction}: {len(l1_pages)} L1 pages vs {len(host_pages)} host pages")
        t0 = time.monotonic_ns()
        n, h0, page_bytes = len(l1_pages), host_pages[0], self.geometry.bytes_per_page
        one_run = host_pages[-1] == h0 + n - 1 and list(host_pages) == list(range(h0, h0 + n))  # C-speed check
        # [(first index, end index, first page)]; None: more runs than DMAs take
        runs = [(0, n, h0)] if one_run else host_runs(host_pages, max_runs=MAX_DMA_RUNS)
        host_consecutive = runs is not None and len(runs) == 1
        few_runs = runs is not None and len(runs) > 1  # one DMA per run, straight into/out of the L2 pool
        cpu_gather = runs is None
        if self.cuda or (direction == "d2h" and cpu_gather):
            self.refuse_if_closed(direction)
        if cpu_gather and self.host_reads:
            return self._kernel_transfer(direction, l1_pages, host_pages, t0)
        pipelined = self.cuda and n >= 8 and not few_runs
        tr = Transfer(direction, n, n * page_bytes, 0, 0, t0, synchronous=not self.cuda)
        host_idx = torch.tensor(host_pages, dtype=torch.int64) if cpu_gather else None
        try:
            if pipelined and direction == "d2h" and host_consecutive:  # the copy engine first
                self._direct_out(l1_pages, self.l2.page_buffer.data_ptr() + h0 * page_bytes, tr,
                                 cuda_rt.current_stream(self.l1.device))
            ws, tr.setup_ns = self.workspaces.acquire(n, needs_host=cpu_gather)
            tr.workspace = ws
            packed = ws.device[:n]       # [n, 2, L, S, H, D]
            host_dst = (self.l2.page_buffer[h0: h0 + n] if host_consecutive  # [n, 2, L, S, H, D] pinned
                        else ws.host[:n] if cpu_gather else None)
            if direction == "h2d" and cpu_gather:  # host gather: L2 [P2, 2, L, S, H, D] at host_idx [n]
                torch.index_select(self.l2.page_buffer, 0, host_idx, out=ws.host[:n])  # -> [n, 2, L, S, H, D]
            if pipelined:
                self._pipelined(direction, l1_pages, ws, packed, host_dst, tr)
            else:
                idx = self._index(l1_pages)  # produced on the caller's stream
                tr.keepalive.append(idx)
                pairs = ([(packed, host_dst)] if not few_runs else
                         [(packed[i0:i1], self.l2.page_buffer[r0: r0 + i1 - i0]) for i0, i1, r0 in runs])
                self._whole(direction, idx, packed, pairs, tr)
        except Exception as exc:  # a launch or a DMA that cannot be enqueued fails the transfer, not the caller
            self._not_enqueued(tr, exc)
        if direction == "d2h" and cpu_gather and not tr.fail:  # one CPU index copy into fragmented L2 pages, off the loop
            tr.finish = functools.partial(self.l2.page_buffer.index_copy_, 0, host_idx, ws.host[:n])
        if self.faults is not None and self.faults.should_fire(Fault.TRANSFER_RAISE):
            tr.fail = True
        tr.enqueue_ns = time.monotonic_ns() - t0 - tr.setup_ns
        return tr

    def _events(self, tr: Transfer) -> None:
        """The transfer's timing events; `enqueued_event` and `ready_event` are recorded now."""
        tr.start_event = torch.cuda.Event(enable_timing=True)
        tr.event = torch.cuda.Event(enable_timing=True)
        tr.enqueued_event = torch.cuda.Event(enable_timing=True)
        tr.ready_event = torch.cuda.Event(enable_timing=True)
        tr.enqueued_event.record(self._clock_stream)
        tr.ready_event.record(cuda_rt.current_stream(self.l1.device))

    def _direct_out(self, l1_pages: list[int], host_ptr: int, tr: Transfer, caller: torch.cuda.Stream) -> int:
        """A D2H's first `direct_pages` pages straight out of L1 into the page-major host buffer at
        `host_ptr`, one 2-D DMA each, on the D2H copy stream after it waited for the caller's stream
        (the KV was written there); starts the transfer's clock. Returns how many pages it took."""
        copy_stream = self.copy_streams["d2h"]
        direct = min(len(l1_pages), self.direct_pages)
        self._events(tr)
        copy_stream.wait_stream(caller)
        tr.start_event.record(copy_stream)
        if direct:
            self._memcpy_2d(page_out_copies(self.geometry, self.l1.num_pages, l1_pages[:direct], range(direct),
                                            dst_base=host_ptr, src_base=self.l1.kv.data_ptr()),
                            copy_stream, to_host=True)
        return direct

    def _kernel_transfer(self, direction: str, l1_pages: list[int], host_pages: list[int], t0: int) -> Transfer:
        """Fragmented L2 pages <-> L1 by a copy kernel that reaches pinned L2 over PCIe: no
        workspace, no CPU gather or index copy. H2D on the H2D copy stream (flags of its own, no
        reader waits on them); D2H on the D2H kernel stream."""
        n = len(l1_pages)
        tr = Transfer(direction, n, n * self.geometry.bytes_per_page, 0, 0, t0)
        if direction == "h2d":
            self._h2d_epoch = self._h2d_epoch % EPOCH_LIMIT + 1  # (int32 flags; nothing waits on these)
            tr.epoch = epoch = self._h2d_epoch
            self._copy_kernel(tr, self.copy_streams["h2d"], host_pages, l1_pages, None,
                              lambda pages, stream: self.host_copy.h2d_layers(pages, self._counts["h2d"],
                                                                              self._h2d_flags, epoch, stream,
                                                                              beside_forward=False))
        else:
            self._copy_kernel(tr, self.kernel_streams["d2h"], host_pages, l1_pages, None, self.host_copy.d2h_pages)
        if self.faults is not None and self.faults.should_fire(Fault.TRANSFER_RAISE):
            tr.fail = True
        tr.enqueue_ns = time.monotonic_ns() - t0
        return tr

    def _whole(self, direction: str, idx: torch.Tensor, packed: torch.Tensor, pairs, tr: Transfer) -> None:
        """One kernel and one DMA per L2 run (fewer than 8 pages, L2 pages in 2-8 runs at any
        length, the CPU): idx [n] L1 pages; packed [n, 2, L, S, H, D] device workspace; pairs =
        [(packed slice, L2 or pinned workspace slice)], page-major."""
        stream = self.kernel_streams[direction] if self.cuda else None
        if self.cuda:
            stream.wait_stream(cuda_rt.current_stream(self.l1.device))
            self._events(tr)
        with torch.cuda.stream(stream) if self.cuda else _null():
            if self.cuda:
                tr.start_event.record(stream)
            if direction == "d2h":
                gather_pages(self.l1.kv, idx, packed, self.backends.gather)
                for dev, host in pairs:
                    host.copy_(dev, non_blocking=self.cuda)
            else:
                for dev, host in pairs:
                    dev.copy_(host, non_blocking=self.cuda)
                scatter_pages(packed, idx, self.l1.kv, self.backends.scatter)
            if self.cuda:
                tr.event.record(stream)
                idx.record_stream(stream)

    def _not_enqueued(self, tr: Transfer, exc: Exception) -> None:
        """A transfer whose kernels or DMAs could not all be enqueued fails (its waiter gets
        TransferError, and the operation falls back with its pages and locks released); on CUDA it
        completes once whatever was enqueued before the failure has run, so its workspace is free."""
        tr.fail, tr.error = True, f"{tr.direction}: not enqueued: {exc!r}"
        if self.cuda:
            stream = self.copy_streams[tr.direction]
            stream.wait_stream(self.kernel_streams[tr.direction])
            self._events(tr)
            tr.start_event.record(stream)
            tr.event.record(stream)

    def _pipelined(self, direction: str, l1_pages: list[int], ws: Workspace, packed: torch.Tensor,
                   host: torch.Tensor, tr: Transfer) -> None:
        """packed [n, 2, L, S, H, D] device workspace; host [n, 2, L, S, H, D] pinned (the L2 run,
        or the pinned workspace). Chunked: the kernel of chunk i+1 runs on the SMs while the copy
        engine moves chunk i, so a transfer costs its DMA plus the small chunk's kernel rather than
        the sum of both. The first DMA is enqueued before anything else: a D2H's first pages
        straight out of L1 (`_direct_out`, maybe already done by the caller), an H2D's first chunk
        into the workspace (it waits for nothing: only the scatters write L1, and they wait on the
        caller's stream; but into a workspace allocated just now it waits for the caller's stream,
        whose memory pool may have handed out a block that stream freed but had not finished
        with)."""
        kernel_stream, copy_stream = self.kernel_streams[direction], self.copy_streams[direction]
        n = len(l1_pages)
        if direction == "d2h":
            caller = cuda_rt.current_stream(self.l1.device)
            direct = (self._direct_out(l1_pages, host.data_ptr(), tr, caller) if tr.start_event is None
                      else min(n, self.direct_pages))
            if direct == n:
                tr.event.record(copy_stream)
                return
            kernel_stream.wait_stream(caller)  # the KV of these pages was written there
            idx = self._stage_index(ws, l1_pages[direct:], kernel_stream)  # [n - direct]
            lo = direct
            for size in gathered_chunks(n - direct, direct, self.first_chunk_pages):
                hi, ready = lo + size, torch.cuda.Event()  # explicit streams: no `with torch.cuda.stream()`
                gather_pages(self.l1.kv, idx[lo - direct:hi - direct], packed[lo:hi], self.backends.gather,
                             kernel_stream)  # gather on the SMs, then DMA the chunk out
                ready.record(kernel_stream)
                copy_stream.wait_event(ready)
                self._dma(host, packed, lo, hi, copy_stream)
                lo = hi
            tr.event.record(copy_stream)
            self._keep_index(tr, ws, idx, kernel_stream)
        else:
            self._events(tr)
            self._h2d_chunks(l1_pages, ws, host, copy_stream, kernel_stream, tr, start=tr.start_event)
            tr.event.record(kernel_stream)

    def _h2d_chunks(self, l1_pages: list[int], ws: Workspace, host: torch.Tensor, copy_stream: torch.cuda.Stream,
                    kernel_stream: torch.cuda.Stream, tr: Transfer, start=None) -> None:
        """The H2D pipeline: chunks of `host` (consecutive L2 pages, [n, 2, L, S, H, D]) DMA'd into
        the workspace on `copy_stream`, each scattered into its L1 pages on `kernel_stream` (which
        first waits for the caller's stream, the pages' last readers). `start` is recorded on the
        copy stream right before the first DMA."""
        n, packed = len(l1_pages), ws.device[:len(l1_pages)]  # [n, 2, L, S, H, D]
        sizes = ramp_chunks(n, self.first_chunk_pages, RAMP_GROWTH)
        sizes.reverse()  # the small chunk last: its scatter is all that follows the DMAs
        if ws.fresh is not None:  # a workspace allocated just now: its memory's last users first
            copy_stream.wait_event(ws.fresh)
            ws.fresh = None
        if start is not None:
            start.record(copy_stream)
        self._dma(packed, host, 0, sizes[0], copy_stream)  # DMA the chunk in, then scatter it
        kernel_stream.wait_stream(cuda_rt.current_stream(self.l1.device))  # last readers of the L1 pages
        idx = self._stage_index(ws, l1_pages, kernel_stream)  # [n]
        lo = 0
        for i, size in enumerate(sizes):
            hi, ready = lo + size, torch.cuda.Event()
            if i:
                self._dma(packed, host, lo, hi, copy_stream)
            ready.record(copy_stream)
            kernel_stream.wait_event(ready)
            scatter_pages(packed[lo:hi], idx[lo:hi], self.l1.kv, self.backends.scatter, kernel_stream)
            lo = hi
        self._keep_index(tr, ws, idx, kernel_stream)

    @staticmethod
    def _keep_index(tr: Transfer, ws: Workspace, idx: torch.Tensor, stream: torch.cuda.Stream) -> None:
        if idx.data_ptr() != ws.index_device.data_ptr():  # staged by torch (no raw DMA on this machine)
            tr.keepalive.append(idx)
            idx.record_stream(stream)

    def _stage_index(self, ws: Workspace, pages: list[int], stream: torch.cuda.Stream) -> torch.Tensor:
        """The page index of a pipelined transfer on the device, for kernels on `stream`: written
        into the workspace's pinned index and copied by one DMA on that stream (no allocation, no
        wait on another stream; the buffers are the transfer's until it completes). [len(pages)]"""
        m = len(pages)
        if self._memcpy is None:
            idx = self._index(pages)
            stream.wait_stream(cuda_rt.current_stream(self.l1.device))  # the copy ran there
            return idx
        ws.index_np[:m] = pages
        self._memcpy(ws.index_device.data_ptr(), ws.index_host.data_ptr(), m * 8, stream)
        return ws.index_device[:m]

    def _dma(self, dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int, stream: torch.cuda.Stream) -> None:
        """Pages [lo, hi) of src into the same pages of dst on `stream`: both [n, 2, L, S, H, D],
        contiguous (page-major)."""
        if self._memcpy is None:
            with torch.cuda.stream(stream):
                dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
            return
        page_bytes = self.geometry.bytes_per_page
        self._memcpy(dst.data_ptr() + lo * page_bytes, src.data_ptr() + lo * page_bytes, (hi - lo) * page_bytes, stream)

    # -- completion ----------------------------------------------------------------------------
    async def wait(self, tr: Transfer) -> Transfer:
        """Await completion without spinning the loop; raises TransferError on a failed transfer.
        The transfer's buffers are given back once it has settled, also when the waiter is
        cancelled first (they used to be given back at the cancellation, while the copy still ran
        into them). A transfer completes once: a later or concurrent wait awaits that completion
        (regression: a second wait ran a fragmented D2H's CPU index copy again, from a workspace
        already given back and reused by another transfer)."""
        done = self.completion(tr)
        if done is not None:
            await asyncio.shield(done)
        if tr.fail:
            raise TransferError(tr.error or f"{tr.direction}: injected transfer failure", tr.fail_kind)
        return tr

    def completion(self, tr: Transfer) -> asyncio.Future | None:
        """The transfer's completion, started once (None: `wait_blocking` completed it). What an abandoned copy's
        pages wait for before they are freed (OpRunner._in_flight): a future, which no asyncio.run() that ends
        cancels, where a task over `wait` is (regression: a cancelled wait was taken for the copy's end, and its
        pages freed while the copy still ran into them)."""
        done = self._completions.get(tr)
        if done is None:
            if tr.event is None and tr.finish is None:
                done = asyncio.get_running_loop().create_future()
                try:
                    tr.complete()
                    done.set_result(None)
                except Exception as exc:
                    done.set_exception(exc)
                finally:
                    self._settled(tr)
            elif self._closed:  # no waiter thread is left to complete it (regression: the pool's "cannot schedule
                # new futures after shutdown" escaped, counted as a `transfer` failure, its workspace kept for good)
                done = COMPLETED
                try:
                    if tr.event is not None:  # (its buffers are given back only once its copy is done)
                        tr.event.synchronize()
                finally:
                    self._settled(tr)
                tr.fail, tr.error, tr.fail_kind = True, f"{tr.direction}: transfer engine closed", "closed"
            else:
                done = asyncio.get_running_loop().run_in_executor(self._waiters[tr.direction], tr.complete)
                done.add_done_callback(lambda _: self._settled(tr))
            self._completions[tr] = done
        return None if done is COMPLETED else done

    def _settled(self, tr: Transfer) -> None:
        self.workspaces.release(tr.workspace)
        self.page_lists.release(tr.page_list)
        tr.workspace = tr.page_list = None
        tr.keepalive.clear()

    def wait_blocking(self, tr: Transfer) -> Transfer:
        """Wait on this thread, polling (benchmarks, tests). It completes the transfer once, as `wait`
        does (regression: a `wait` after it ran a fragmented D2H's `finish` again, and it kept the
        transfer's sources alive)."""
        if tr not in self._completions:
            try:
                tr.complete(poll=True)
            finally:
                self._settled(tr)
            self._completions[tr] = COMPLETED
        if tr.fail:
            raise TransferError(tr.error or f"{tr.direction}: injected transfer failure", tr.fail_kind)
        return tr

    def close(self) -> None:
        if self.cuda:
            for stream in (*self.kernel_streams.values(), *self.copy_streams.values(), self.layer_stream,
                           self.layer_kernel_stream):
                stream.synchronize()
        self._closed = True
        for waiter in self._waiters.values():
            waiter.shutdown(wait=True)
        self.workspaces.clear()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

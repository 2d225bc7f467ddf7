"""Layer-ordered L2 -> L1 restores (`h2d_layerwise`), part of `TransferEngine` (hicache/transfer.py
holds its streams, workspaces, pipelines and copy kernels): the 2-D DMA plan of
hicache/layer_copy.py, each layer followed by its flag (kernels/layer_flags.py), or one copy kernel
that reads pinned L2 (short or fragmented restores, narrow slabs). A restore longer than the forward
that waits for it may first move its first pages whole, by the H2D pipeline (one DMA per chunk and a
scatter), before layer 0: beside a running forward the 2-D DMAs of 32 KiB rows moved 8-12 % below
the pinned copy's rate on the H200 (a stream of skinny GEMMs: 21-24 % at 1,000 tokens, 11-13 % at
3,500), the whole pages, landing
before the forward has work, at that rate (docs/benchmarks.md, session 21)."""
from __future__ import annotations

import time

import torch

from hicache.faults import Fault
from hicache.layer_copy import layer_plan, run_layer_cpu, run_layer_cuda
from hicache.transfer_record import Transfer, TransferError
from kernels import cuda_rt
from kernels.page_copy import scatter_pages


class LayeredRestores:
    """Mixin of `TransferEngine`: its layer-ordered restores."""

    def h2d_layerwise(self, host_pages: list[int], l1_pages: list[int], whole_pages: int = 0) -> Transfer | None:
        """L2 -> L1 in layer order, straight into the L1 pages (2-D DMAs, no staging; restores of at
        most kernel_max_pages, pages split in more runs than the DMA plan takes, or slabs too narrow
        for 2-D DMAs: one copy kernel reading pinned L2); on CUDA
        `layer_flags.flags[l]` reaches the transfer's `epoch` once layer l has landed. None when this
        machine cannot (or, without the kernel, the pages are too fragmented): the caller uses h2d(). A forward
        that reads these pages waits for each layer's flag to reach that epoch, and is launched
        after this returns: a wait kernel spinning on copies enqueued after it was seen to stall
        the copies on the H200 (streams promise no forward progress to each other).
        whole_pages: the first this many pages (at most n - 1) go before layer 0, whole
        (`_whole_first`), when they are consecutive in L2 and the rest takes the DMA plan (restores
        by the copy kernel take none); every flag then also covers them."""
        if not self.layerwise or not l1_pages:
            return None
        if self.cuda:
            self.refuse_if_closed("h2d")
        if len(l1_pages) != len(host_pages):
            raise TransferError(f"h2d: {len(l1_pages)} L1 pages vs {len(host_pages)} host pages")
        t0 = time.monotonic_ns()
        n = len(l1_pages)
        short = self.host_reads and (n <= self.kernel_max_pages or self.narrow_slabs)
        whole = 0 if short else min(max(0, whole_pages), n - 1)
        if whole and list(host_pages[:whole]) != list(range(host_pages[0], host_pages[0] + whole)):
            whole = 0  # (one pipeline only: the L2 pages of the whole part must be consecutive)
        plan = None if short else layer_plan(self.geometry, self.l1.num_pages, l1_pages[whole:], host_pages[whole:])
        if plan is None:  # the rest too fragmented for the DMA plan, so are all the pages (more runs): by the kernel
            whole = 0
        if plan is None and not self.host_reads:
            return None
        tr = Transfer("h2d", n, n * self.geometry.bytes_per_page, 0, 0, t0, synchronous=not self.cuda)
        if self.faults is not None and self.faults.should_fire(Fault.TRANSFER_RAISE):
            tr.fail = True
        if plan is None:
            flags = self.layer_flags
            tr.epoch = flags.next_epoch()
            self._copy_kernel(tr, self.layer_stream, host_pages, l1_pages, flags,
                              lambda pages, stream: self.host_copy.h2d_layers(pages, self._counts["layer"],
                                                                              flags.flags, tr.epoch, stream))
        else:
            self._enqueue_layers(tr, plan, host_pages[:whole], l1_pages[:whole])
        tr.enqueue_ns = time.monotonic_ns() - t0 - tr.setup_ns
        return tr

    def _enqueue_layers(self, tr: Transfer, plan, whole_host: list[int], whole_l1: list[int]) -> None:
        """The copies of a layer-ordered transfer (on the CPU: done when this returns), after its
        whole pages if any (`_whole_first`). A copy that cannot be enqueued fails the transfer, not
        the caller; every flag is still written, so no forward ever waits for it."""
        stream, flags = self.layer_stream, self.layer_flags
        if self.cuda:
            tr.epoch = flags.next_epoch()
            self._events(tr)
            stream.wait_stream(cuda_rt.current_stream(self.l1.device))  # its last reader of these pages
            tr.start_event.record(stream)
        landed = 0
        l1_ptr, l2_ptr = self.l1.kv.data_ptr(), self.l2.page_buffer.data_ptr()
        try:
            if whole_l1:
                self._whole_first(tr, whole_host[0], whole_l1)
            for copies in plan:
                if self.cuda:
                    run_layer_cuda(copies, l1_ptr, l2_ptr, stream)
                    flags.signal(stream, landed, tr.epoch)
                else:
                    run_layer_cpu(copies, self.l1.kv, self.l2.page_buffer)
                landed += 1
        except Exception as exc:
            tr.fail, tr.error = True, f"h2d: layer {landed} not copied: {exc!r}"
            if self.cuda:  # the whole pages' scatters enqueued so far: the transfer completes after them
                stream.wait_stream(self.layer_kernel_stream)
            for layer in range(landed, len(plan) if self.cuda else 0):
                flags.signal(stream, layer, tr.epoch)
        if self.cuda:
            tr.event.record(stream)

    def _whole_first(self, tr: Transfer, h0: int, l1_pages: list[int]) -> None:
        """A layer-ordered restore's first pages (L2 pages h0, h0 + 1, ... into `l1_pages`), whole:
        CUDA: pipelined DMAs into a workspace on the layer stream, scattered into L1 on the layer
        kernel stream, which the layer stream then waits for (its first flag must cover them; only
        the last, small chunk's scatter is left when the DMAs end). The CPU: one scatter."""
        n = len(l1_pages)
        host = self.l2.page_buffer[h0: h0 + n]  # [n, 2, L, S, H, D]
        if not self.cuda:
            idx = torch.tensor(l1_pages, dtype=torch.int64)
            scatter_pages(host, idx, self.l1.kv, self.backends.scatter)
            return
        ws, tr.setup_ns = self.workspaces.acquire(n, needs_host=False)
        tr.workspace = ws
        self._h2d_chunks(l1_pages, ws, host, self.layer_stream, self.layer_kernel_stream, tr)
        scattered = torch.cuda.Event()
        scattered.record(self.layer_kernel_stream)
        self.layer_stream.wait_event(scattered)

"""Scratch buffers of the transfer engine (hicache/transfer.py): every gather/scatter transfer (and
a layer-ordered restore's whole pages) packs its pages into a page-major device workspace; only the
fallback CPU gather (fragmented L2 pages without the copy kernels) also uses a pinned host half.
Copy-kernel transfers take none, only a pinned page list (`PageLists`). Allocating them costs far
more than the copy (pinned memory especially), so they are reused: best fit, at most one idle one
kept (the largest), the pinned half allocated only when a transfer needs it. The time a first allocation takes is the transfer's `setup_ns`, a one-time cost the cost
model never learns from."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hicache.geometry import KVGeometry
from kernels import cuda_rt


@dataclass(eq=False)
class Workspace:
    num_pages: int
    device: torch.Tensor                # [num_pages, 2, L, S, H, D] on the compute device
    host: torch.Tensor | None = None    # same shape, pinned; allocated lazily (fragmented paths only)
    busy: bool = False
    # a pipelined transfer's L1 page index (CUDA): written on the host, copied by one DMA on the
    # kernel stream; both are the transfer's until it completes, like the workspace
    index_host: torch.Tensor | None = None  # [num_pages] int64, pinned
    index_device: torch.Tensor | None = None  # [num_pages] int64
    index_np: object = None                 # index_host as a numpy array (the host writes it)
    # CUDA, just allocated: recorded on the allocating (compute) stream, whose memory pool may have
    # handed out a block that stream freed but still uses; a side stream's first write waits for it
    fresh: object = None                    # torch.cuda.Event | None


class Workspaces:
    def __init__(self, geometry: KVGeometry, device: torch.device) -> None:
        self.geometry, self.device = geometry, device
        self.cuda = device.type == "cuda"
        self._all: list[Workspace] = []

    def acquire(self, num_pages: int, needs_host: bool) -> tuple[Workspace, int]:
        """A free workspace of at least `num_pages` pages (with its pinned half if `needs_host`),
        and the ns spent allocating (0 when one was reused)."""
        t0 = time.monotonic_ns()
        free = [w for w in self._all if not w.busy and w.num_pages >= num_pages]
        free.sort(key=lambda w: (w.num_pages, w.host is None))
        if free:
            ws = free[0]
        else:
            shape = self.geometry.page_major_shape(num_pages)
            ws = Workspace(num_pages, torch.empty(shape, dtype=self.geometry.dtype, device=self.device))
            if self.cuda:
                ws.index_host = torch.empty(num_pages, dtype=torch.int64, pin_memory=True)
                ws.index_device = torch.empty(num_pages, dtype=torch.int64, device=self.device)
                ws.index_np = ws.index_host.numpy()
                ws.fresh = torch.cuda.Event()
                ws.fresh.record(cuda_rt.current_stream(self.device))
            self._all.append(ws)
        if needs_host and ws.host is None:
            ws.host = torch.empty(self.geometry.page_major_shape(ws.num_pages), dtype=self.geometry.dtype,
                                  pin_memory=self.cuda)
        ws.busy = True
        return ws, time.monotonic_ns() - t0

    def release(self, ws: Workspace | None) -> None:
        """Give `ws` back; keep at most one idle workspace: the largest (preferring one with its
        pinned half)."""
        if ws is None:
            return
        ws.busy = False
        idle = [w for w in self._all if not w.busy]
        if len(idle) > 1:
            keep = max(idle, key=lambda w: (w.num_pages, w.host is not None))
            self._all = [w for w in self._all if w.busy or w is keep]

    def clear(self) -> None:
        self._all.clear()

    def __iter__(self):
        return iter(list(self._all))

    def __len__(self) -> int:
        return len(self._all)


class PageLists:
    """Pinned page lists for the copy kernels (kernels/host_copy.py), which read them over PCIe as
    they read L2: the host writes a transfer's list and the launch follows, with no H2D copy of the
    list and no stream wait for that copy (3 of the ~8 runtime calls of a restore's enqueue, each
    20-40 us on the H200's host; docs/benchmarks.md session 32). A list is its transfer's until the
    transfer settles; given back, it is reused best fit. One not given back (a transfer never
    waited for) goes with its transfer."""

    MAX_IDLE = 8

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin  # (False: tests of the bookkeeping on a machine without CUDA)
        self._idle: list[torch.Tensor] = []  # flat [2 * capacity] int32, pinned

    def acquire(self, host_pages: list[int], l1_pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the buffer, to give back; [2, n] int32 pinned in it: row 0 the L2 pages, row 1 the L1 pages)."""
        n = len(host_pages)
        fits = [i for i, buf in enumerate(self._idle) if buf.numel() >= 2 * n]
        if fits:
            buf = self._idle.pop(min(fits, key=lambda i: self._idle[i].numel()))
        else:
            buf = torch.empty(2 * max(64, 1 << (n - 1).bit_length()), dtype=torch.int32, pin_memory=self.pin)
        pages = buf[:2 * n].view(2, n)
        rows = pages.numpy()
        rows[0], rows[1] = host_pages, l1_pages
        return buf, pages

    def release(self, buf: torch.Tensor | None) -> None:
        if buf is None:
            return
        self._idle.append(buf)
        if len(self._idle) > self.MAX_IDLE:
            smallest = min(range(len(self._idle)), key=lambda i: self._idle[i].numel())
            self._idle.pop(smallest)

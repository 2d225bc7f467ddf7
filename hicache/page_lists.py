"""Page lists for the copy kernels (kernels/host_copy.py), staged for one stream without allocating.

A copy kernel reads its [2, n] int32 page list (row 0 L2 pages, row 1 L1 pages) from the device. A
fresh `torch.tensor(...).to(device)` per restore costs a tensor, a pageable copy on the caller's
stream and one more cross-stream wait, all on the loop's path to the forward. Here each stream
gets a few slots of pinned host + device buffers: the host writes the list into a slot, one raw
DMA on the kernel's own stream moves it, and the kernel launched after it on that stream reads it
(stream order; the next DMA into that device buffer comes after the kernel). A slot's host half is
reused only once the event recorded behind its DMA has passed, so a DMA still queued never reads
a list overwritten under it; when every slot is still in flight the caller falls back to the
plain copy (`stage` returns None).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SLOTS = 4


@dataclass(eq=False)
class _Slot:
    host: torch.Tensor       # [2 * capacity] int32, pinned
    device: torch.Tensor     # [2 * capacity] int32
    host_np: np.ndarray      # host as numpy, written by the loop
    event: torch.cuda.Event  # recorded behind the slot's last DMA

    @property
    def capacity(self) -> int:
        return self.host.shape[0] // 2


class PageLists:
    def __init__(self, device: torch.device, memcpy) -> None:
        self.device = device
        self.memcpy = memcpy  # cuda_rt.memcpy_async(dst_ptr, src_ptr, num_bytes, stream)
        self._slots: dict[int, list[_Slot | None]] = {}  # stream handle -> ring
        self._next: dict[int, int] = {}

    def stage(self, stream: torch.cuda.Stream, host_pages: list[int], l1_pages: list[int],
              keepalive: list) -> torch.Tensor | None:
        """[2, n] int32 on the device (contiguous: row 0 L2 pages, row 1 L1 pages), ready for
        kernels enqueued on `stream` after this call; the slot goes into `keepalive` (held until the
        transfer completes). None when the next slot's previous DMA has not run yet."""
        n = len(host_pages)
        ring = self._slots.setdefault(stream.cuda_stream, [None] * SLOTS)
        i = self._next.get(stream.cuda_stream, 0)
        slot = ring[i]
        if slot is not None and not slot.event.query():
            return None
        if slot is None or slot.capacity < n:
            capacity = max(n, 64, 2 * (slot.capacity if slot is not None else 0))
            host = torch.empty(2 * capacity, dtype=torch.int32, pin_memory=True)
            slot = ring[i] = _Slot(host, torch.empty(2 * capacity, dtype=torch.int32, device=self.device),
                                   host.numpy(), torch.cuda.Event())
        self._next[stream.cuda_stream] = (i + 1) % SLOTS
        slot.host_np[:n] = host_pages
        slot.host_np[n:2 * n] = l1_pages
        self.memcpy(slot.device.data_ptr(), slot.host.data_ptr(), 2 * n * 4, stream)
        slot.event.record(stream)
        keepalive.append(slot)
        return slot.device[:2 * n].view(2, n)

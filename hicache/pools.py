"""The memory of each tier: the L1 device pool (attention's layout) and the L2 page-major host pool."""
from __future__ import annotations

import torch

from hicache.allocator import PageAllocator
from hicache.geometry import KVGeometry
from hicache.pinned import pinned_zeros


class DevicePool:
    """L1: `kv` is [2, layer, page, token_in_page, kv_head, head_dim] on the compute device."""

    def __init__(self, geometry: KVGeometry, num_pages: int, device: torch.device, simulate: bool = False) -> None:
        self.geometry = geometry
        self.num_pages = num_pages
        self.device = torch.device(device)
        shape = geometry.l1_shape(0 if simulate else num_pages)  # simulate: bookkeeping only
        self.kv = torch.zeros(shape, dtype=geometry.dtype, device=self.device)
        self.allocator = PageAllocator(num_pages, "l1")


class HostPool:
    """L2: `page_buffer` is page-major [page, 2, layer, token_in_page, kv_head, head_dim], pinned when
    CUDA is present (hicache/pinned.py), so one page is one contiguous run of bytes across all layers."""

    def __init__(self, geometry: KVGeometry, num_pages: int, pin: bool, simulate: bool = False) -> None:
        self.geometry = geometry
        self.num_pages = num_pages
        shape = geometry.page_major_shape(0 if simulate else num_pages)
        if pin and not simulate:
            self.page_buffer = pinned_zeros(self, shape, geometry.dtype)
        else:
            self.page_buffer = torch.zeros(shape, dtype=geometry.dtype)
        self.pinned = pin
        self.allocator = PageAllocator(num_pages, "l2")

    @property
    def buffer(self) -> torch.Tensor:
        """The same memory viewed in L1 order: [2, layer, page, token_in_page, kv_head, head_dim]."""
        return self.page_buffer.permute(1, 2, 0, 3, 4, 5)

"""KV geometry shared by every tier: how many bytes a token and a page take, and the fixed layouts.

Layouts (fixed, see DESIGN.md section 3):
  L1 (device):   [2 (K/V), layer, page, token_in_page, kv_head, head_dim]   attention's layout
  L2 (host):     [page, 2, layer, token_in_page, kv_head, head_dim]         page-major
  L3 (file):     page p lives at byte offset p * bytes_per_page, same bytes as one L2 page
A "packed" buffer used by transfers has the L2 (page-major) layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # tokens per page
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVGeometry.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def slab_elements(self) -> int:
        """Elements of one (kv, layer) slab of one page: [token_in_page, kv_head, head_dim]."""
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def page_elements(self) -> int:
        """Elements of one whole page across K/V and all layers."""
        return 2 * self.num_layers * self.slab_elements

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.page_elements * self.itemsize

    def l1_shape(self, num_pages: int) -> tuple[int, ...]:
        return (2, self.num_layers, num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def page_major_shape(self, num_pages: int) -> tuple[int, ...]:
        return (num_pages, 2, self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def describe(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_page": self.bytes_per_page,
        }

"""Page gather/scatter kernels (Triton) with torch references and a backend chooser."""
from kernels.chooser import ChosenBackends, choose_backends
from kernels.page_copy import (
    gather_pages,
    gather_pages_torch,
    gather_pages_triton,
    packed_to_l1_offsets,
    scatter_pages,
    scatter_pages_torch,
    scatter_pages_triton,
    triton_available,
)

__all__ = [
    "ChosenBackends", "choose_backends", "gather_pages", "gather_pages_torch", "gather_pages_triton",
    "packed_to_l1_offsets", "scatter_pages", "scatter_pages_torch", "scatter_pages_triton",
    "triton_available",
]

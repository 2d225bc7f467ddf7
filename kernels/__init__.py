"""Device kernels (Triton, and CUDA runtime calls): page gather/scatter with torch references and a backend
chooser (exported here), and the forward's: decode attention, fused norms, skinny GEMMs, rejection sampling, layer
flags for restores landing under the forward, host copies and launch helpers (each module says what it is)."""
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

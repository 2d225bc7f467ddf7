"""Regressions from session 52's hunt of the copy and attention kernels: a strided page-id list is refused (the Triton
gather read it with stride 1 and copied other pages); 2-D DMAs are not planned where L1's slab rows are further apart
than a copy's largest pitch (qwen3-0.6b's pool on the H200); a head_dim the CUDA decode kernel cannot take is refused
as the model loads, not at its first decode step."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hicache.layer_copy import MAX_DMA_PITCH_BYTES, l1_pitch_fits
from kernels.page_copy import gather_pages_torch, gather_pages_triton, scatter_pages_torch, scatter_pages_triton
from scheduler.model import check_head_dim
from scheduler.presets import PRESETS


@pytest.mark.parametrize("copy", [gather_pages_triton, gather_pages_torch, scatter_pages_triton, scatter_pages_torch])
def test_a_strided_page_id_list_is_refused(copy):
    l1 = torch.randn(2, 2, 6, 4, 2, 8)  # [2, L, P, S, H, D]
    ids = torch.tensor([5, 0, 4, 1, 3, 2])[::2]  # [5, 4, 3], a view of stride 2
    packed = torch.empty(3, 2, 2, 4, 2, 8)
    args = (l1, ids, packed) if copy in (gather_pages_triton, gather_pages_torch) else (packed, ids, l1)
    with pytest.raises(ValueError, match="contiguous"):
        copy(*args)
    copy(*[a.contiguous() if a is ids else a for a in args])  # (its contiguous copy is taken)


def test_2d_dmas_only_where_l1s_pitch_fits():
    small = PRESETS["qwen3-0.6b"].kv_geometry(16, torch.bfloat16)
    slab_bytes = small.slab_elements * small.itemsize
    assert l1_pitch_fits(small, MAX_DMA_PITCH_BYTES // slab_bytes)
    assert not l1_pitch_fits(small, 72_055)  # (the H200's L1 budget of it: a 2.36 GB pitch)
    assert l1_pitch_fits(PRESETS["qwen3-8b"].kv_geometry(16, torch.bfloat16), 24_000)


@pytest.mark.parametrize("head_dim, served_on_cuda", [(128, True), (16, True), (64, True), (96, False), (80, False),
                                                       (8, False)])
def test_a_head_dim_the_decode_kernel_cannot_take_is_refused_on_cuda(head_dim, served_on_cuda):
    cfg = dataclasses.replace(PRESETS["tiny"], head_dim=head_dim)
    check_head_dim(cfg, torch.device("cpu"))  # (the CPU serves any)
    if served_on_cuda:
        check_head_dim(cfg, torch.device("cuda"))
    else:
        with pytest.raises(ValueError, match=f"head_dim {head_dim}"):
            check_head_dim(cfg, torch.device("cuda"))


def test_the_host_copy_kernels_refuse_a_strided_page_list():
    from kernels import host_copy
    from kernels.page_copy import triton_available
    if not triton_available():
        pytest.skip("needs triton (the interpreter on the CPU)")
    l1 = torch.zeros(2, 3, 12, 4, 2, 16)
    l2 = torch.ones(9, 2, 3, 4, 2, 16)
    pages = torch.tensor([[7, 11], [0, 2], [3, 5], [4, 0]], dtype=torch.int32).t()  # ([2, n], a transposed view)
    with pytest.raises(ValueError, match="contiguous"):
        host_copy.HostCopy(l2, l1, 1).d2h_pages(pages)
    host_copy.HostCopy(l2, l1, 1).d2h_pages(pages.contiguous())

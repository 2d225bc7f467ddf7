"""Offsets past 2^31 in the copy kernels that reach pinned L2 (kernels/host_copy.py), in the Triton interpreter.

Triton computes in int32 unless an operand is int64. A tier may have up to MAX_TIER_PAGES (2^31 - 1) pages, and
both kernels formed an L1 slab row as `slab * pool_pages` in int32 (slab < 2L, pool_pages an int32 argument):
with (2L - 1) * pool_pages >= 2^31 the row wrapped and the K/V went to (or came from) another place in L1. The
8B shape on the H200 stays far below (at most ~49M: 71 slabs x ~680k one-token pages), but a pool of tiny pages
within the tier limit is past it; page_copy.py already widens every such product to int64.

These tests need no 2 GiB of memory: L1 is a view into a sparse anonymous mapping (untouched pages cost nothing),
placed 2 GiB past the mapping's start so that a wrapped (negative) offset lands inside the mapping instead of
crashing the interpreter, and is seen as a page that did not land.
"""
import mmap
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede importing triton / kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import host_copy  # noqa: E402
from kernels.page_copy import triton_available  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available() or torch.cuda.is_available(),
                                reason="needs triton's interpreter on the CPU (sparse host memory as L1)")

LAYERS = 36  # the 8B shape's layers; slabs of one byte, so the pool's size is what crosses 2^31
POOL_PAGES = (1 << 31) // (2 * LAYERS - 1) + 1  # the last slab's row, (2L - 1) * pool_pages, is past 2^31
GUARD_BYTES = 1 << 31  # room for a wrapped row's negative offset before L1


@pytest.fixture
def sparse_l1() -> torch.Tensor:
    """L1 [2, L, POOL_PAGES, 1, 1, 1] uint8 (~2.2 GB of address space, no memory until written), fresh per test
    (a wrapped write of one test must not be what the next one reads)."""
    l1_bytes = 2 * LAYERS * POOL_PAGES
    region = mmap.mmap(-1, GUARD_BYTES + l1_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(region, dtype=torch.uint8)
    assert (2 * LAYERS - 1) * POOL_PAGES >= 1 << 31
    return buf[GUARD_BYTES:].view(2, LAYERS, POOL_PAGES, 1, 1, 1)


def _l2_pages(num_pages: int) -> torch.Tensor:
    """[n, 2, L, 1, 1, 1] uint8, every slab a distinct nonzero byte."""
    values = torch.arange(num_pages * 2 * LAYERS, dtype=torch.int64) % 251 + 1
    return values.to(torch.uint8).view(num_pages, 2, LAYERS, 1, 1, 1)


def test_h2d_layers_lands_every_slab_of_the_last_l1_page(sparse_l1):
    l2 = _l2_pages(2)
    l1_pages = [POOL_PAGES - 1, POOL_PAGES // 2]
    counts, flags = torch.zeros(LAYERS, dtype=torch.int32), torch.zeros(LAYERS, dtype=torch.int32)
    pages = torch.tensor([[0, 1], l1_pages], dtype=torch.int32)
    host_copy.HostCopy(l2, sparse_l1, programs=4).h2d_layers(pages, counts, flags, 1)
    for host, page in enumerate(l1_pages):
        assert torch.equal(sparse_l1[:, :, page], l2[host])
    assert flags.tolist() == [1] * LAYERS


def test_d2h_pages_reads_every_slab_of_the_last_l1_page(sparse_l1):
    want = _l2_pages(1)[0]  # [2, L, 1, 1, 1]
    sparse_l1[:, :, POOL_PAGES - 1] = want
    l2 = torch.zeros(2, 2, LAYERS, 1, 1, 1, dtype=torch.uint8)
    pages = torch.tensor([[1], [POOL_PAGES - 1]], dtype=torch.int32)
    host_copy.HostCopy(l2, sparse_l1, programs=4).d2h_pages(pages)
    assert torch.equal(l2[1], want)
    assert not l2[0].any()

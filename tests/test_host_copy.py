"""The copy kernel that reads pinned L2 over PCIe into L1, layer by layer (kernels/host_copy.py), in
the Triton interpreter: every listed page lands in its L1 page and no other page changes, each
layer's flag reaches the epoch, its count is back to zero for the next launch; bad shapes are
refused; and the reverse kernel that writes L1 pages into scattered L2 pages. (On the GPU: tests/test_gpu_transfers.py, fragmented transfers.)"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede importing triton / kernels

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import host_copy  # noqa: E402
from kernels.page_copy import triton_available  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton (interpreter on the CPU)")


def pools(layers=3, l1_pages=12, l2_pages=9, s=4, h=2, d=16, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    l1 = torch.zeros(2, layers, l1_pages, s, h, d, dtype=dtype)
    l2 = torch.randint(1, 100, (l2_pages, 2, layers, s, h, d), generator=gen).to(dtype)
    return l1, l2


@pytest.mark.parametrize("programs,dtype", [(1, torch.bfloat16), (3, torch.bfloat16), (64, torch.float32)])
def test_listed_pages_land_layer_by_layer_and_nothing_else_changes(programs, dtype):
    l1, l2 = pools(dtype=dtype)
    layers = l1.shape[1]
    counts, flags = torch.zeros(layers, dtype=torch.int32), torch.zeros(layers, dtype=torch.int32)
    rng = random.Random(programs)
    for epoch in (1, 2):  # a second launch reuses the counts the first one reset
        l1.zero_()
        host, dst = rng.sample(range(9), 5), rng.sample(range(12), 5)
        pages = torch.tensor([host, dst], dtype=torch.int32)
        host_copy.HostCopy(l2, l1, programs).h2d_layers(pages, counts, flags, epoch)
        for h, p in zip(host, dst):
            assert torch.equal(l1[:, :, p], l2[h])
        others = sorted(set(range(12)) - set(dst))
        assert not l1[:, :, others].any()
        assert flags.tolist() == [epoch] * layers
        assert counts.tolist() == [0] * layers


@pytest.mark.parametrize("programs", [1, 4, 64])
def test_d2h_writes_each_l1_page_into_its_l2_page_and_nothing_else(programs):
    l1, _ = pools(seed=1)
    l1.copy_(torch.randint(1, 100, l1.shape, generator=torch.Generator().manual_seed(5)).to(l1.dtype))
    l2 = torch.zeros(9, 2, 3, 4, 2, 16, dtype=l1.dtype)
    host, src = [7, 0, 3, 4], [11, 2, 5, 0]
    host_copy.HostCopy(l2, l1, programs).d2h_pages(torch.tensor([host, src], dtype=torch.int32))
    for h, p in zip(host, src):
        assert torch.equal(l2[h], l1[:, :, p])
    assert not l2[[1, 2, 5, 6, 8]].any()


def test_items_smaller_than_a_slab_still_cover_it(monkeypatch):
    """A slab split in several items (the 8B slab is 32 KiB, items at most 16 KiB)."""
    monkeypatch.setattr(host_copy, "MAX_BLOCK_BYTES", 64)
    l1, l2 = pools(s=4, h=2, d=16)  # 256-byte slabs: 4 items each
    assert host_copy.plan_words(256) == (torch.int64, 32, 8, 1)
    counts, flags = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    copier = host_copy.HostCopy(l2, l1, programs=5)
    copier.h2d_layers(torch.tensor([[8, 0], [11, 2]], dtype=torch.int32), counts, flags, 7)
    assert torch.equal(l1[:, :, 11], l2[8]) and torch.equal(l1[:, :, 2], l2[0])
    assert flags.tolist() == [7, 7, 7] and counts.tolist() == [0, 0, 0]
    l2.zero_()
    copier.d2h_pages(torch.tensor([[3], [11]], dtype=torch.int32))
    assert torch.equal(l2[3], l1[:, :, 11]) and not l2[[0, 1, 2, 4, 5, 6, 7, 8]].any()


def test_plan_words_takes_the_widest_word_and_a_power_of_two_share():
    assert host_copy.plan_words(32 << 10) == (torch.int64, 4096, 2048, 1)  # 8B slab: two 16 KiB items
    assert host_copy.plan_words(2 << 10) == (torch.int64, 256, 256, 8)  # one-token page: 8 slabs an item
    assert host_copy.plan_words(6) == (torch.int16, 3, 1, 64)  # at most MAX_ROWS slabs
    assert host_copy.plan_words(12) == (torch.int32, 3, 1, 64)


@pytest.mark.parametrize("max_block_bytes,rows", [(512, 2), (1024, 4), (16 << 10, 64)])
def test_small_slabs_move_several_an_item_and_cover_every_page(monkeypatch, max_block_bytes, rows):
    """Regression: one-token pages' 2 KiB slabs moved one an item ran at 8-18 GiB/s on the H200;
    now an item takes several slabs in a row (pages of one slab restoring, slabs of one page backing
    up), the last group of each partly masked: 7 pages are 4 groups of 2 and 2 of 4; a page's 6 slabs
    are 3 groups of 2, 2 of 4 (the second half empty), 1 of 64."""
    monkeypatch.setattr(host_copy, "MAX_BLOCK_BYTES", max_block_bytes)
    l1, l2 = pools(s=4, h=2, d=16)  # 256-byte slabs
    assert host_copy.plan_words(256)[3] == rows
    counts, flags = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    copier = host_copy.HostCopy(l2, l1, programs=3)
    host, dst = [8, 0, 5, 2, 7, 1, 3], [11, 2, 0, 9, 4, 6, 10]
    copier.h2d_layers(torch.tensor([host, dst], dtype=torch.int32), counts, flags, 4)
    for h, p in zip(host, dst):
        assert torch.equal(l1[:, :, p], l2[h])
    assert not l1[:, :, [1, 3, 5, 7, 8]].any()
    assert flags.tolist() == [4, 4, 4] and counts.tolist() == [0, 0, 0]
    l2.zero_()
    copier.d2h_pages(torch.tensor([[3, 6, 0], [11, 2, 9]], dtype=torch.int32))
    assert torch.equal(l2[3], l1[:, :, 11]) and torch.equal(l2[6], l1[:, :, 2]) and torch.equal(l2[0], l1[:, :, 9])
    assert not l2[[1, 2, 4, 5, 7, 8]].any()


def test_bad_arguments_are_refused():
    l1, l2 = pools()
    counts, flags = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    copier = host_copy.HostCopy(l2, l1)
    with pytest.raises(ValueError, match="int32"):
        copier.h2d_layers(torch.tensor([[0], [1]]), counts, flags, 1)
    with pytest.raises(ValueError, match=r"\[2, n\]"):
        copier.h2d_layers(torch.tensor([0, 1], dtype=torch.int32), counts, flags, 1)
    with pytest.raises(ValueError, match="int32"):
        copier.d2h_pages(torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="does not match"):
        host_copy.HostCopy(l2[:, :, :2], l1)
    with pytest.raises(ValueError, match="contiguous"):
        host_copy.HostCopy(l2.transpose(0, 1).contiguous().transpose(0, 1), l1)
    copier.h2d_layers(torch.zeros((2, 0), dtype=torch.int32), counts, flags, 1)  # nothing to do
    assert not l1.any() and not flags.any()


def test_warm_up_touches_nothing():
    l1, l2 = pools()
    counts, flags = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    host_copy.HostCopy(l2, l1).warm_up(counts, flags)
    assert not l1.any() and not flags.any() and not counts.any()


def test_kernel_restore_threshold_is_validated_and_reaches_the_transfer_engine():
    import argparse

    from hicache.config import HiCacheConfig
    from scheduler.config import EngineConfig, add_engine_args, config_from_args

    with pytest.raises(ValueError, match="kernel-restore-max-tokens"):
        HiCacheConfig(kernel_restore_max_tokens=-1)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--enable-hicache", "--hicache-kernel-restore-max-tokens", "64"])
    assert config_from_args(args).hicache.kernel_restore_max_tokens == 64
    assert parser.parse_args([]).hicache_kernel_restore_max_tokens == HiCacheConfig.kernel_restore_max_tokens

    from scheduler.engine import Engine
    cfg = EngineConfig(model="tiny", device="cpu", num_pages=32, page_size=4).with_hicache(
        enable=True, kernel_restore_max_tokens=64)
    transfer = Engine(cfg).cache.transfer
    assert transfer.kernel_max_pages == 16  # 64 tokens of 4-token pages
    assert not transfer.host_reads  # CPU pools: plain copies, never the kernels


def test_a_restore_beside_its_forward_launches_more_programs_than_background_copies():
    """A layer-ordered restore's forward waits for its copy, so it gets BESIDE_FORWARD_PROGRAMS
    (64: the tail forward behind a 1,000-token restore 0.2 ms sooner than at 16 on the H200,
    session 26); backups run beside decode, and so do restores nothing waits beside (the classic
    H2D of fragmented pages), and keep BACKGROUND_PROGRAMS (16). Every launch is capped by its items;
    `programs` sets them all. The grid is recorded where the kernel is launched."""
    l1, l2 = pools(s=64, h=8, d=128, l1_pages=4, l2_pages=4, layers=8)  # 128 KiB slabs: 8 items each
    counts, flags = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    many = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32)  # 4 pages x 16 slabs x 8 items

    def grids(copier):
        launched = []
        copier._run = lambda kernel, grid, stream, *args: launched.append(grid)
        copier.h2d_layers(many, counts, flags, 1)
        copier.h2d_layers(many, counts, flags, 1, beside_forward=False)
        copier.d2h_pages(many)
        return launched

    assert host_copy.BESIDE_FORWARD_PROGRAMS == 64 and host_copy.BACKGROUND_PROGRAMS == 16
    assert grids(host_copy.HostCopy(l2, l1)) == [(64,), (16,), (16,)]
    assert grids(host_copy.HostCopy(l2, l1, programs=5)) == [(5,), (5,), (5,)]
    l1, l2 = pools()  # 256-byte slabs, 64 an item: 3 pages are one item
    copier = host_copy.HostCopy(l2, l1)
    assert copier._grid(torch.zeros((2, 3), dtype=torch.int32), "beside_forward") == (1,)
    with pytest.raises(ValueError, match="programs must be >= 1"):
        host_copy.HostCopy(l2, l1, programs=0)


def test_a_restore_beside_its_forward_takes_at_most_half_the_sms():
    """128 programs on the H200's 132 SMs made the forward beside the copy 0.9-2.6 ms slower
    (session 26): a smaller GPU gets half its SMs, the CPU (no SMs) BESIDE_FORWARD_PROGRAMS."""
    assert host_copy.beside_forward_programs(None) == host_copy.BESIDE_FORWARD_PROGRAMS
    assert host_copy.beside_forward_programs(132) == 64
    assert host_copy.beside_forward_programs(58) == 29
    assert host_copy.beside_forward_programs(1) == 1

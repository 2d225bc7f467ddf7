"""Session 35's review hunt: regression tests for bugs found in the memory plan (scheduler/memory_plan.py,
4c4bdd0 and 880e6a5): a simulated deployment's L2 and L3 held to this machine's memory and disk, an L3
file left at --hicache-storage-path by the last run not counted as the free space it is, and (CUDA) an
L1 sized from memory that torch's cache still held for an engine already gone."""
from __future__ import annotations

import os

import pytest
import torch

from hicache.config import HiCacheConfig
from scheduler.config import EngineConfig
from scheduler.memory_plan import disk_free_bytes, plan_pools
from scheduler.presets import get_preset
from scheduler.replay_memory import pool_pages

QWEN8 = get_preset("qwen3-8b")
GEOMETRY = QWEN8.kv_geometry(16, torch.bfloat16)  # 2.25 MiB a page
GIB = 1 << 30


def test_a_simulated_deployments_l2_and_l3_are_not_held_to_this_machines_memory_and_disk():
    """regression: `plan_pools` held a ratio-sized L2 to half this machine's memory and a ratio-sized
    L3 to half its free disk under --simulate too, where neither holds a byte (no pinned L2, no L3
    file): a replay simulating a large deployment (replay_trace.py --simulate --l1-gib 100, L2 and L3
    by their ratios) silently simulated smaller tiers, set by the machine that ran it, and not the
    pages `replay_memory.pool_pages` (the replay's memory check) counts for the same config."""
    l1_pages = 1000
    hc = HiCacheConfig(enable=True, host_ratio=1e6, storage_ratio=2.0)  # L2 ~2.1 PiB, L3 ~4.3 PiB of KV
    cfg = EngineConfig(model="qwen3-8b", device="cpu", dtype="bfloat16", page_size=16, num_pages=l1_pages,
                       simulate=True, hicache=hc)
    pages, planned = plan_pools(cfg, torch.device("cpu"), QWEN8, GEOMETRY, "qwen3-8b")
    bpp = GEOMETRY.bytes_per_page
    host_pages = planned.host_pages(pages, bpp)
    assert (pages, host_pages, planned.storage_pages(host_pages, bpp)) == (l1_pages, 10**9, 2 * 10**9)
    assert pool_pages(cfg) == {"L1": l1_pages, "L2": 10**9, "L3": 2 * 10**9}


def test_an_l3_file_left_at_the_storage_path_counts_as_free_space(tmp_path):
    """regression: a server restarted with the same --hicache-storage-path found its last run's file
    there, whose blocks the new file reuses (hicache/storage_file.py truncates it and counts them as
    available), but `disk_free_bytes` did not count them: a ratio-sized L3 held to half the free disk
    got half of what its predecessor left free (47 GiB free: 23.5 GiB, then 11.75 at the restart)."""
    path = tmp_path / "l3.kv"
    size_bytes = GIB
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size_bytes)  # the blocks of a reserved L3 file, nothing written
        except OSError:
            pytest.skip("this file system cannot reserve a file's blocks")
    finally:
        os.close(fd)
    if os.stat(path).st_blocks * 512 < size_bytes:
        pytest.skip("this file system did not reserve the blocks")
    st = os.statvfs(tmp_path)
    free_without_file = st.f_bavail * st.f_frsize
    counted = disk_free_bytes(HiCacheConfig(enable=True, storage_path=str(path)))
    assert counted is not None and counted - free_without_file > size_bytes // 2, (counted, free_without_file)
    # a path with no file yet: the file system's free space, as before
    other = disk_free_bytes(HiCacheConfig(enable=True, storage_path=str(tmp_path / "none.kv")))
    assert other is not None and abs(other - free_without_file) < size_bytes // 2


@pytest.mark.gpu  # (the GPU's memory is read; skipped without CUDA: tests/conftest.py)
def test_an_engine_sized_from_memory_after_another_counts_what_that_one_freed():
    """regression (CUDA): L1 was sized from `torch.cuda.mem_get_info` as it read, where the blocks of an
    engine already gone (replay_trace.py --compare-no-cache builds its baseline's engine after the
    replay's; tests build many) still sat in torch's caching allocator, or in a reference cycle gc had
    not collected yet: they read as in use, and the second engine was refused (fewer than a request's
    pages) or got a far smaller L1."""
    from scheduler.engine import Engine

    cfg = EngineConfig(model="qwen3-0.6b", device="cuda", max_total_tokens=0, gpu_memory_fraction=0.5,
                       cuda_graphs=False)  # (graphs' pools aside: what L1 reads is the point)
    first = Engine(cfg)
    first_pages = first.cache.l1.num_pages
    first.check_integrity()
    del first  # (an engine is a reference cycle: its tensors go at gc's next collection)
    second = Engine(cfg)
    assert second.cache.l1.num_pages >= 0.9 * first_pages, (second.cache.l1.num_pages, first_pages)
    second.check_integrity()

"""L1 sized from the GPU's memory and a ratio-sized L2 held to the host's (scheduler/memory_plan.py): the
arithmetic against hand-computed budgets, the refusal naming the flags, the CLI's defaults, and the CPU's
fallback. The reading of a real GPU's memory: tests/test_gpu.py."""
from __future__ import annotations

import argparse

import pytest
import torch

from hicache.config import HiCacheConfig
from scheduler.config import DEFAULT_L1_TOKENS, EngineConfig, add_engine_args, config_from_args
from scheduler.engine import Engine
from scheduler.memory_plan import (FIXED_RESERVE_BYTES, GIB, HOST_SHARE, activation_reserve_bytes,
                                   host_config_within_memory, l1_budget_pages)
from scheduler.presets import get_preset

QWEN8 = get_preset("qwen3-8b")
GEOMETRY = QWEN8.kv_geometry(16, torch.bfloat16)  # 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes x 16 tokens


def test_the_reserve_counts_a_prefill_batch_and_a_decode_batchs_logits():
    cfg = EngineConfig(max_prefill_tokens=2048, max_running_requests=64)
    per_token = (8 * 4096 + 4 * 12288 + 2 * (32 + 16) * 128) * 2
    assert activation_reserve_bytes(QWEN8, cfg, 2) == 2048 * per_token + 64 * 151936 * 4 * 8 + FIXED_RESERVE_BYTES
    smaller = EngineConfig(max_prefill_tokens=512, max_running_requests=8)
    assert activation_reserve_bytes(QWEN8, smaller, 2) < activation_reserve_bytes(QWEN8, cfg, 2)


def test_l1_takes_what_the_fraction_leaves_after_whats_in_use_and_the_reserve():
    """An H200 of 139.8 GiB with the 8B preset's 16.4 GiB of weights in use: at 0.9, ~107 GiB of L1,
    ~785,000 tokens (a 16-token page of the 8B shape is 2.25 MiB)."""
    cfg = EngineConfig(gpu_memory_fraction=0.9)
    total, used = int(139.8 * GIB), int(16.4 * GIB)
    pages = l1_budget_pages(cfg, QWEN8, GEOMETRY, total, used)
    assert GEOMETRY.bytes_per_page == 16 * 36 * 8 * 128 * 2 * 2
    want = (int(0.9 * total) - used - activation_reserve_bytes(QWEN8, cfg, 2)) // GEOMETRY.bytes_per_page
    assert pages == want and 770_000 < pages * 16 < 800_000
    assert l1_budget_pages(EngineConfig(gpu_memory_fraction=0.5), QWEN8, GEOMETRY, total, used) < pages


def test_a_fraction_that_leaves_no_room_is_refused_naming_the_flags():
    cfg = EngineConfig(gpu_memory_fraction=0.12)
    with pytest.raises(ValueError, match="--gpu-memory-fraction 0.12.*--max-total-tokens"):
        l1_budget_pages(cfg, QWEN8, GEOMETRY, int(139.8 * GIB), int(16.4 * GIB))
    # exactly the least: 2 pages + a 4,096-token request's
    least = 2 + 4096 // 16
    reserve = activation_reserve_bytes(QWEN8, EngineConfig(), 2)
    total = (least * GEOMETRY.bytes_per_page + reserve) * 10  # fraction 0.1 of it: the reserve and `least` pages
    assert l1_budget_pages(EngineConfig(gpu_memory_fraction=0.1), QWEN8, GEOMETRY, total, 0) == least
    with pytest.raises(ValueError):
        l1_budget_pages(EngineConfig(gpu_memory_fraction=0.1), QWEN8, GEOMETRY, total, GEOMETRY.bytes_per_page)


def test_a_ratio_sized_l2_is_held_to_half_the_hosts_memory():
    hc = HiCacheConfig(enable=True, host_ratio=2.0)
    bpp = GEOMETRY.bytes_per_page
    l1_pages = int(107 * GIB) // bpp  # an auto-sized L1 on the H200
    held = host_config_within_memory(hc, l1_pages, bpp, 128 * GIB)  # 214 GiB asked of a 128 GiB host
    assert held.host_size_gb is not None and held.host_size_gb <= HOST_SHARE * 128
    assert held.host_pages(l1_pages, bpp) == int(HOST_SHARE * 128 * GIB) // bpp
    assert host_config_within_memory(hc, 1000, bpp, 128 * GIB) is hc  # 4.4 GiB: as asked
    sized = HiCacheConfig(enable=True, host_size_gb=300.0)
    assert host_config_within_memory(sized, l1_pages, bpp, 128 * GIB) is sized  # given in GiB: as asked
    assert host_config_within_memory(hc, l1_pages, bpp, None) is hc  # the host's memory unknown
    off = HiCacheConfig(enable=False)
    assert host_config_within_memory(off, l1_pages, bpp, 128 * GIB) is off


def _cli(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(argv))


def test_the_cli_sizes_l1_from_memory_unless_told_and_the_cpu_falls_back():
    cfg = _cli([])
    assert cfg.max_total_tokens == 0 and cfg.gpu_memory_fraction == 0.9
    assert _cli(["--max-total-tokens", "4096", "--gpu-memory-fraction", "0.5"]).max_total_tokens == 4096
    assert EngineConfig().max_total_tokens == 8192  # the library's default is unchanged
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=0))
    assert eng.cache.l1.num_pages == DEFAULT_L1_TOKENS // 4
    eng.check_integrity()


def test_the_servers_start_line_says_what_each_tier_holds():
    from scheduler.memory_plan import pools_line
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=100).with_hicache(
        enable=True, host_ratio=2.0, storage_ratio=0.0))
    line = pools_line(eng.status())
    assert line.startswith("tiny on cpu (float32): L1 400 tokens (0.20 MiB), L2 800 tokens"), line
    assert "L3" not in line
    eng.check_integrity()
    plain = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=100))
    assert pools_line(plain.status()) == "tiny on cpu (float32): L1 400 tokens (0.20 MiB)"  # (regression: L2 None)


def test_a_ratio_sized_l3_file_is_held_to_half_the_free_disk():
    from scheduler.memory_plan import DISK_SHARE, storage_config_within_disk
    bpp = GEOMETRY.bytes_per_page
    hc = HiCacheConfig(enable=True, host_size_gb=60.0, storage_ratio=2.0)  # 120 GiB of L3 asked
    held = storage_config_within_disk(hc, 1000, bpp, 47 * GIB)  # the H200 machine's free disk
    assert held.storage_size_gb is not None and held.storage_size_gb <= DISK_SHARE * 47
    assert held.storage_pages(held.host_pages(1000, bpp), bpp) == int(DISK_SHARE * 47 * GIB) // bpp
    assert storage_config_within_disk(hc, 1000, bpp, 500 * GIB) is hc  # room enough: as asked
    for kept in (HiCacheConfig(enable=True, host_size_gb=60.0, storage_size_gb=100.0),  # given in GiB
                 HiCacheConfig(enable=True, host_size_gb=60.0, storage_backend="redis",
                               storage_url="redis://127.0.0.1:6379/0"),
                 HiCacheConfig(enable=True, host_size_gb=60.0, storage_ratio=0.0)):
        assert storage_config_within_disk(kept, 1000, bpp, 47 * GIB) is kept
    assert storage_config_within_disk(hc, 1000, bpp, None) is hc
    assert storage_config_within_disk(hc, 1000, bpp, bpp) is hc  # not a page: the file's check says so


def test_an_engine_asked_for_more_l3_than_the_disk_has_starts_with_less(monkeypatch):
    """End to end on the CPU: a ratio that asks for more L3 than twice the free space of its file
    system (10**6 x L2) starts, holding L3 to half that space, where the file's check refused it. (The
    temporary file's blocks are reserved without being written, and go with the engine.) The engine
    sees the free space the test measured: other processes' files come and go between two measures
    (random-order seed 6603 failed by 0.001 %, with more free space at the engine's)."""
    import asyncio

    from scheduler import memory_plan
    hc = HiCacheConfig(enable=True, host_ratio=1.0, storage_ratio=1e6)
    free = memory_plan.disk_free_bytes(hc)
    monkeypatch.setattr(memory_plan, "disk_free_bytes", lambda _hc: free)
    bpp = get_preset("tiny").kv_geometry(4, torch.float32).bytes_per_page
    if free is None or 100 * 1e6 * bpp < free:
        pytest.skip("this file system has more free space than the test asks for")
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=100, hicache=hc))
    try:
        assert 0 < eng.cache.store.num_slots * bpp <= 0.5 * free
        eng.check_integrity()
    finally:
        asyncio.run(eng.cache.close())  # the temporary L3 file goes

"""Second hunt over the memory plan (scheduler/memory_plan.py) and the server's start-up flags
(scheduler/serve.py): regression tests for an L2 of no page refused naming a flag that did not size
it, a held L2 / L3 on a huge host or disk refused naming a size flag nobody gave, the fraction's
refusal advising to raise a fraction already at 1, and --hicache-storage-path values the server only
refused (naming no flag) after loading the model."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import hicache.simulated
from hicache.config import MAX_TIER_PAGES, HiCacheConfig
from scheduler import serve
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.memory_plan import (GIB, activation_reserve_bytes, host_config_within_memory, l1_budget_pages,
                                   plan_pools, storage_config_within_disk)
from scheduler.presets import get_preset

QWEN8 = get_preset("qwen3-8b")
GEOMETRY = QWEN8.kv_geometry(16, torch.bfloat16)  # 2.25 MiB a page
TINY = get_preset("tiny")
TINY_ONE = TINY.kv_geometry(1, torch.float32)  # 512 bytes a page: 2**31 pages are 1 TiB


def _tiny_l2(**hicache) -> EngineConfig:
    return EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=100).with_hicache(enable=True, **hicache)


def test_an_l2_the_hosts_memory_leaves_no_page_is_refused_naming_what_sized_it(monkeypatch):
    """regression: a ratio-sized L2 held to half the memory this process may have (a tiny ulimit -v
    or cgroup limit), where that half holds no page, was refused as "L2 would hold no page; raise
    --hicache-ratio / --hicache-size-gb": raising the ratio changes nothing (the hold sized it)."""
    monkeypatch.setattr(hicache.simulated, "memory_limit_bytes", lambda: 3000)  # half: 1,500 < 2,048 bytes a page
    with pytest.raises(ValueError) as info:
        Engine(_tiny_l2(host_ratio=2.0))
    message = str(info.value)
    assert "--hicache-ratio 2.0" in message and "memory" in message and "raise --hicache-ratio" not in message


def test_an_l2_of_no_page_names_only_the_flag_that_sized_it():
    """regression: --hicache-size-gb 0 (or a size under one page) was refused advising to raise
    --hicache-ratio, which a size in GiB overrides; and a ratio of 0 named --hicache-size-gb."""
    with pytest.raises(ValueError, match="--hicache-size-gb") as info:
        Engine(_tiny_l2(host_size_gb=0.0))
    assert "--hicache-ratio" not in str(info.value)
    with pytest.raises(ValueError, match="--hicache-ratio") as info:
        Engine(_tiny_l2(host_ratio=0.0))
    assert "--hicache-size-gb 0" not in str(info.value)
    cfg = _tiny_l2(host_ratio=0.0).with_hicache(storage_ratio=0.0)
    with pytest.raises(ValueError, match="--hicache-ratio"):  # simulated: refused the same way
        plan_pools(replace(cfg, simulate=True), torch.device("cpu"), TINY,
                   TINY.kv_geometry(4, torch.float32), "tiny")


def test_an_l2_held_on_a_huge_host_is_held_to_the_pages_a_tier_can_have():
    """regression: a ratio-sized L2 held to half a host of 4 TiB (here 512-byte pages) got 2**32
    pages, more than a tier can have, and was refused naming --hicache-size-gb, which was not given."""
    hc = HiCacheConfig(enable=True, host_ratio=1e6)
    l1_pages = 8192  # asks 8.2e9 pages of L2
    held = host_config_within_memory(hc, l1_pages, TINY_ONE.bytes_per_page, 4 << 40)
    assert held.host_pages(l1_pages, TINY_ONE.bytes_per_page) == MAX_TIER_PAGES


def test_an_l3_held_on_a_huge_disk_is_held_to_the_pages_a_tier_can_have():
    """regression: the same for a ratio-sized L3 file held to half 8 TiB of free disk: refused
    naming --hicache-storage-size-gb, which was not given."""
    bpp = TINY_ONE.bytes_per_page
    hc = HiCacheConfig(enable=True, host_ratio=2.0, storage_ratio=1e6)
    held = storage_config_within_disk(hc, 8192, bpp, 8 << 40)
    assert held.storage_pages(held.host_pages(8192, bpp), bpp) == MAX_TIER_PAGES


def test_a_fraction_of_1_that_leaves_no_room_does_not_advise_raising_it():
    """regression: weights larger than the whole GPU's share were refused with "raise it" at a
    --gpu-memory-fraction of 1 already; the reserve's flags (what can still give room) went unnamed."""
    reserve = activation_reserve_bytes(QWEN8, EngineConfig(), 2)
    total = 20 * GIB
    with pytest.raises(ValueError) as info:
        l1_budget_pages(EngineConfig(gpu_memory_fraction=1.0), QWEN8, GEOMETRY, total, total - reserve)
    message = str(info.value)
    assert "raise it" not in message and "--max-prefill-tokens" in message and "--max-total-tokens" in message
    with pytest.raises(ValueError, match="raise --gpu-memory-fraction"):  # below 1: raising it may help
        l1_budget_pages(EngineConfig(gpu_memory_fraction=0.5), QWEN8, GEOMETRY, total, total // 2)


@pytest.mark.parametrize("path_of", [lambda tmp: "", lambda tmp: str(tmp), lambda tmp: str(tmp / "no" / "l3.kv")],
                         ids=["empty", "a-directory", "no-such-directory"])
def test_a_storage_path_that_cannot_be_used_is_refused_naming_the_flag_before_the_model_loads(
        tmp_path, capsys, path_of):
    """regression: --hicache-storage-path "" (an unset variable) was refused as the current
    directory ("refusing L3 storage path '/cwd': it exists and is not a regular file"), and a
    directory, or a path in none, were refused naming no flag, each only after the model was loaded
    (minutes, for a checkpoint)."""
    rc = serve.main(["--port", "0", "--model", "tiny", "--device", "cpu", "--enable-hicache", "--hicache-storage-path",
                     path_of(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("hicache-serve: --hicache-storage-path") and err.count("\n") == 1, err

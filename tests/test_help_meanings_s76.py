"""--help against what the program does (session 76): a flag's text must not promise what the code does otherwise.

* --hicache-ratio / --hicache-storage-ratio said "L2 pages = ratio x L1 pages" / "L3 pages = ratio x L2 pages",
  where scheduler/memory_plan.py holds a ratio-sized L2 to half the memory the process may have and a ratio-sized
  L3 file to half its file system's free space (a log warning only): an operator sized the tiers by the text.
* --api-key said "the /v1/ routes ask for" the key, naming the routes that stay open, where /reset_prefix_cache
  asks for it too (scheduler/api_auth.py `_guarded`): a script resetting the cache without the key got a 401.
"""
from __future__ import annotations

import re
from pathlib import Path

from hicache.config import HiCacheConfig
from scheduler import memory_plan
from scheduler.api_auth import _guarded
from scheduler.serve import build_parser

GIB = 1 << 30


def _help(dest: str) -> str:
    action = next(a for a in build_parser()._actions if a.dest == dest)
    return " ".join(action.help.split())


def test_l2_ratio_is_held_to_half_the_host_memory_and_the_help_says_so():
    asked = HiCacheConfig(enable=True, host_ratio=4.0)
    held = memory_plan.host_config_within_memory(asked, l1_pages=1024, bytes_per_page=1 << 20, limit_bytes=2 * GIB)
    assert held.host_size_gb == memory_plan.HOST_SHARE * 2  # 1 GiB, not the 4 GiB the ratio asks
    assert "half the memory" in _help("hicache_ratio")


def test_l3_ratio_is_held_to_half_the_free_disk_and_the_help_says_so():
    asked = HiCacheConfig(enable=True, host_ratio=1.0, storage_ratio=8.0)
    held = memory_plan.storage_config_within_disk(asked, l1_pages=1024, bytes_per_page=1 << 20, free_bytes=2 * GIB)
    assert held.storage_size_gb == memory_plan.DISK_SHARE * 2  # 1 GiB, not the 8 GiB the ratio asks
    assert "half the free space" in _help("hicache_storage_ratio")


def _server_routes() -> set[str]:
    source = (Path(__file__).resolve().parents[1] / "scheduler" / "server.py").read_text()
    return set(re.findall(r'@(?:app\.(?:get|post|delete)|get)\("(/[^"{]*)', source))


def test_api_key_help_names_every_route_that_asks_for_the_key():
    text = _help("api_key")
    routes = _server_routes()
    assert "/reset_prefix_cache" in routes and "/health" in routes  # (the scan found the routes)
    for path in routes:
        if path.startswith("/v1/"):
            continue  # ("the /v1/ routes")
        asks_for_key = text.split("(401 otherwise")[0]  # the routes named as asking, before those that stay open
        if _guarded(path):
            assert path in asks_for_key, f"{path} asks for the key; --api-key's help does not say so"
        else:
            assert path not in asks_for_key

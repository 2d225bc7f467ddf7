"""Data-free stand-ins for the transfer engine and the L3 store, used by `--simulate` replays:
the tree, allocators, cost model and state machines run exactly as in the engine, but no bytes move
(pages are bookkeeping only), so capacity questions can be asked at sizes no machine here holds."""
from __future__ import annotations

import concurrent.futures as cf
import os
import time
from collections.abc import Sequence

from hicache.geometry import KVGeometry
from hicache.storage import IoResult, coalesce_extents
from hicache.transfer_record import Transfer

# What a simulated tier costs in host memory per page: its PageAllocator's owner table (int64), and,
# for the largest tier, what the integrity check at the end of a replay holds beside it (the free page
# ids and their differences, int64 each, and boolean masks: 17.1 bytes a page measured)
OWNER_TABLE_BYTES_PER_PAGE = 8
CHECK_BYTES_PER_PAGE = 18


def simulated_pool_bytes(tier_pages: Sequence[int]) -> int:
    """Host bytes the bookkeeping of tiers of `tier_pages` pages (L1, L2, L3) needs at its peak."""
    return OWNER_TABLE_BYTES_PER_PAGE * sum(tier_pages) + CHECK_BYTES_PER_PAGE * max(tier_pages, default=0)


def memory_limit_bytes() -> int | None:
    """The most memory this process can have: the machine's physical memory, or less where an
    address-space limit (ulimit -v) or the cgroup's memory.max (a container) says less; None when
    none of them can be read."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        pass
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v2, v1
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():  # ("max": no limit)
            limits.append(int(text))
    return min(limits, default=None)


class NullTransferEngine:
    layerwise = True

    def __init__(self, geometry: KVGeometry) -> None:
        self.geometry = geometry

    def _done(self, direction: str, pages: list[int]) -> Transfer:
        now = time.monotonic_ns()
        return Transfer(direction, len(pages), len(pages) * self.geometry.bytes_per_page, 0, 0, now, done_ns=now)

    def d2h(self, l1_pages: list[int], host_pages: list[int]) -> Transfer:
        return self._done("d2h", l1_pages)

    def h2d(self, host_pages: list[int], l1_pages: list[int]) -> Transfer:
        return self._done("h2d", l1_pages)

    def h2d_layerwise(self, host_pages: list[int], l1_pages: list[int], whole_pages: int = 0) -> Transfer:
        return self._done("h2d", l1_pages)

    async def wait(self, tr: Transfer) -> Transfer:
        return tr

    def completion(self, tr: Transfer) -> None:
        return None  # (done at once)

    def close(self) -> None:
        pass


class NullStore:
    def __init__(self, geometry: KVGeometry, num_slots: int) -> None:
        self.geometry, self.num_slots = geometry, num_slots

    def _done(self, src, dst) -> cf.Future:
        fut: cf.Future = cf.Future()
        fut.set_result(IoResult(len(src) * self.geometry.bytes_per_page, len(coalesce_extents(src, dst)), 0, 0))
        return fut

    def write_pages(self, host_buffer, host_pages, slots) -> cf.Future:
        return self._done(list(host_pages), list(slots))

    def read_pages(self, slots, host_buffer, host_pages) -> cf.Future:
        return self._done(list(slots), list(host_pages))

    def invalidate(self, slots) -> None:
        pass

    def stats(self) -> dict:
        return {"backend": "simulated", "num_slots": self.num_slots}

    def close(self) -> None:
        pass

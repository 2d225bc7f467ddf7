"""Data-free stand-ins for the transfer engine and the L3 store, used by `--simulate` replays:
the tree, allocators, cost model and state machines run exactly as in the engine, but no bytes move
(pages are bookkeeping only), so capacity questions can be asked at sizes no machine here holds."""
from __future__ import annotations

import concurrent.futures as cf
import time

from hicache.geometry import KVGeometry
from hicache.storage import IoResult, coalesce_extents
from hicache.transfer_record import Transfer


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

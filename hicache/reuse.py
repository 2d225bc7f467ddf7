"""Write admission by observed reuse: does writing to a tier pay off on this workload?

The cost model says whether a restore from a tier *could* beat recompute; it cannot say whether a
page written there survives until it is wanted. When a tier is too small for the working set (L2 the
size of L1 under rotating prefixes), every backup is evicted before any request reads it, and the
write-through traffic only slows the engine down (the reference's 21 % loss). Each tier counts the
pages evicted from it and the pages read back from it, in a window that halves both counts whenever
the evictions pass `window_pages`. A tier that evicted at least `min_evicted_pages` without reading
back at least `min_read_fraction` of that is unproductive: the cost policy then writes only every
`probe_every`-th backup to it, so a workload that starts reusing is noticed again.
"""
from __future__ import annotations


class TierReuse:
    def __init__(self, min_evicted_pages: int = 64, window_pages: int = 1024, min_read_fraction: float = 0.01,
                 probe_every: int = 16) -> None:
        if min_evicted_pages < 1 or window_pages < min_evicted_pages or probe_every < 1:
            raise ValueError("need 1 <= min_evicted_pages <= window_pages and probe_every >= 1")
        self.min_evicted_pages, self.window_pages = min_evicted_pages, window_pages
        self.min_read_fraction, self.probe_every = min_read_fraction, probe_every
        self.evicted_pages = 0.0
        self.read_pages = 0.0
        self._declined = 0

    def on_evicted(self, num_pages: int) -> None:
        self.evicted_pages += num_pages
        if self.evicted_pages > self.window_pages:
            self.evicted_pages /= 2
            self.read_pages /= 2

    def on_read(self, num_pages: int) -> None:
        self.read_pages += num_pages

    @property
    def productive(self) -> bool:
        return (self.evicted_pages < self.min_evicted_pages
                or self.read_pages >= self.min_read_fraction * self.evicted_pages)

    def admit(self) -> bool:
        """Write this backup? Always while productive; otherwise every probe_every-th one."""
        if self.productive:
            self._declined = 0
            return True
        self._declined += 1
        if self._declined >= self.probe_every:
            self._declined = 0
            return True
        return False

    def state(self) -> dict:
        return {"evicted_pages": self.evicted_pages, "read_pages": self.read_pages, "productive": self.productive}

"""One deadline for the whole of an L3 read (session 76). A prefetch whose read is verified after its landing waited
for the landing with the read's deadline, then for its checksums with the whole deadline again: a read could take
up to twice its deadline (`io_timeout_s`, docs/design.md "Operations") before it failed. The checksums' wait gets what
is left of the deadline."""
from __future__ import annotations

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, write_prefix

TOKENS = tuple(range(16))
DEADLINE_S = 0.5
PART_S = 0.3  # the landing and the checksums each take this long: each within the deadline, not both


@pytest.mark.asyncio
async def test_a_prefetch_whose_landing_and_checksums_together_outlast_its_deadline_times_out():
    faults = FaultInjector()
    mgr = make_manager(write_policy="write_through", faults=faults, io_timeout_s=DEADLINE_S)
    write_prefix(mgr, TOKENS)
    await mgr.drain()
    await mgr.flush_async(Tier.L1)
    await mgr.flush_async(Tier.L2)
    match = mgr.match(TOKENS + (1,))
    assert match.lengths == [0, 0, 16]
    assert mgr.runner._io_deadline_s(16 * mgr.geometry.bytes_per_page) == DEADLINE_S
    faults.arm(Fault.SLOW_READ, delay_s=PART_S)
    faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=PART_S)
    assert mgr.runner.start_restore(TOKENS, match, "prefetch", None) is not None
    await mgr.drain()
    assert mgr.metrics.failures == {"timeout": 1}
    assert mgr.metrics.prefetches_done == 0
    faults.disarm()
    assert_whole(mgr)
    await mgr.close()

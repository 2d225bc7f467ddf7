"""The cost model learns the truth (bug hunt, session 74): degenerate timings fed to the online cost model must not
decide restores for good.

Pinned here: the reference slope (what a window of one size prices against, hicache/linear_cost.py) comes only from
a fit no one sample decides. The recompute line sees full prefills and restores' short tails until every hit is
restored, and then tails only: it prices long hits with the last reference. That reference was the fit with just two
full prefills left in the window, so one of them 5 x slow (a GC pause, under the hold-back factor) set the recompute
slope at 5.2 x for good, and every L3 hit was restored from a storage slower than recompute; one 10 x fast made it
0.05 x, and none was restored from a storage faster than recompute.
"""
from __future__ import annotations

import pytest

from hicache.config import HiCacheConfig
from hicache.cost_model import CostModel

BPT = 147456  # Qwen3-4B/8B bytes of KV per token
FIXED_S, SLOPE_S = 5e-3, 14e-6  # a prefill forward: 5 ms + 14 us a token


def _prefill_s(num_tokens: int) -> float:
    return FIXED_S + num_tokens * SLOPE_S


@pytest.mark.parametrize("factor, storage_gib_s, truth", [
    (5.0, 3.5, "l1"),     # the last full prefill 5 x slow; an L3 restore at ~42 us a token loses to 14 of recompute
    (0.1, 100.0, "l3"),   # ... 10 x fast (clock or page cache); an L3 restore at ~4 us a token wins
])
def test_one_of_the_last_full_prefills_before_tails_only_does_not_set_the_recompute_slope(factor, storage_gib_s,
                                                                                          truth):
    cm = CostModel(HiCacheConfig(host_bandwidth_gib_s=50.0, storage_bandwidth_gib_s=storage_gib_s,
                                 storage_explore_reads=0, host_explore_transfers=0, restore_explore_every=0), BPT)
    for _ in range(14):  # full prefills and tails: 14 us a token identified
        cm.observe_prefill(15, _prefill_s(15))
        cm.observe_prefill(351, _prefill_s(351))
    assert cm.directions["recompute"].reference_slope == pytest.approx(SLOPE_S)
    cm.observe_prefill(351, factor * _prefill_s(351))  # the last full prefill: one sample off
    for _ in range(200):  # every hit restored from now on: tails only
        cm.observe_prefill(15, _prefill_s(15))
    recompute = cm.directions["recompute"]
    assert recompute.regime == "fixed_only"
    assert SLOPE_S / 2 <= recompute.slope <= 2 * SLOPE_S, recompute.state()
    assert cm.decide(0, 0, 2000).tier == truth, cm.decide(0, 0, 2000).costs

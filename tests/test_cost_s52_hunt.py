"""Regressions from session 52's hunt of the cost policy: an engine restarted on a kept L3 file prices against the
reference slope its predecessor had fitted (a recompute window of restores' short tails alone went back to the
prior's 50 us a token, and restored from a storage slower than recompute)."""
from __future__ import annotations

import pytest

from test_l3_persist import A, _manager, make_manager, write_prefix


def _fitted_then_tails(mgr) -> None:
    """Recompute timed over several lengths (14 us a token + 5 ms), then only restores' tails of 16-18 tokens."""
    for n in [64, 128, 256, 512, 1024, 2048] * 3:
        mgr.cost.observe_prefill(n, 0.005 + n * 14e-6)
    for i in range(40):
        n = 16 + i % 3
        mgr.cost.observe_prefill(n, 0.005 + n * 14e-6)


@pytest.mark.asyncio
async def test_a_restarted_manager_prices_recompute_against_the_fitted_slope(tmp_path):
    mgr = _manager(tmp_path)
    write_prefix(mgr, A, seed=0)
    await mgr.drain()
    _fitted_then_tails(mgr)
    old = mgr.cost.directions["recompute"]
    assert old.regime == "fixed_only" and old.reference_slope == pytest.approx(14e-6)
    want = old.predict(1000)
    await mgr.close()
    nxt = _manager(tmp_path)
    new = nxt.cost.directions["recompute"]
    assert new.reference_slope == pytest.approx(14e-6) and new.samples() == old.samples()
    assert new.predict(1000) == pytest.approx(want, rel=0.05)  # (the prior's slope: 3.3 x)
    await nxt.close()


@pytest.mark.parametrize("references", [{"nowhere": 1e-5}, {"recompute": -1.0}, {"recompute": "fast"},
                                        {"recompute": float("nan")}, {"recompute": True}, {"s2h": 1e9}])
def test_a_malformed_reference_slope_is_refused_before_anything_is_learned(references):
    mgr = make_manager(storage_pages=0)
    with pytest.raises(ValueError, match="reference slope"):
        mgr.cost.learn_again({"recompute": [[16, 1e-3]]}, references)
    assert mgr.cost.directions["recompute"].regime == "prior"
    assert mgr.cost.directions["recompute"].reference_slope == mgr.cost.directions["recompute"].prior_slope


def _model(**config):
    from hicache.config import HiCacheConfig
    from hicache.cost_model import CostModel
    return CostModel(HiCacheConfig(enable=True, **config), 1 << 16)


def _slow_link(cm) -> None:
    """L1 <-> L2 timed both ways at 5 ms + 0.5 GiB/s: a write loses on price unless load hides it."""
    for n in (16, 64, 256, 1024) * 2:
        for direction in ("h2d", "d2h"):
            cm.observe_transfer(direction, n << 16, 0.005 + (n << 16) / (0.5 * 2 ** 30))


def test_writes_explore_an_untimed_tier_a_few_times_then_its_price_decides():
    """An L3 (or L2) no hit ever reads keeps its reads untimed: its writes went ahead of their price for good."""
    from hicache.cost_model import EXPLORE_WRITES
    cm = _model(host_bandwidth_gib_s=0.05, restore_explore_every=0)  # (a prior that prices every write out)
    cm.observe_transfer("d2h", 1 << 20, 1.0)  # (D2H timed; no restore, so H2D stays untimed)
    assert cm.exploring_host
    asks = [cm.worth_writing("l2", 16) for _ in range(EXPLORE_WRITES + 8)]
    assert asks == [True] * EXPLORE_WRITES + [False] * 8
    assert [cm.worth_writing("l3", 16) for _ in range(EXPLORE_WRITES + 1)][-1] is False
    looks = _model(host_bandwidth_gib_s=0.05, restore_explore_every=0)
    assert all(looks.worth_writing("l2", 16, probe=False) for _ in range(EXPLORE_WRITES + 8))  # (looks write nothing)
    cm.observe_transfer("h2d", 1 << 20, 1.0)
    assert not cm.exploring_host and not cm.exploring_writes("l2")


def test_refusals_in_a_row_are_in_a_row():
    """worth_writing probes after explore_every refusals in a row: admitted writes between them counted on."""
    cm = _model(restore_explore_every=4)
    _slow_link(cm)
    probes = 0
    for _ in range(12):
        assert cm.worth_writing("l2", 4096, hidden_s=10.0)  # admitted on its price (load hides it)
        assert cm.worth_writing("l2", 4096, hidden_s=0.0) is cm.write_probe
        probes += cm.write_probe
    assert probes == 0

"""The online cost model: regimes of the linear fit, and the restore / recompute / admission choices."""
from __future__ import annotations

import pytest

from hicache.config import HiCacheConfig
from hicache.cost_model import GIB_BYTES, CostModel
from hicache.linear_cost import CONFIRM_WITHIN, LinearCost

BYTES_PER_TOKEN = 147_456  # Qwen3-4B/8B KV geometry, bf16
MIB = 1 << 20


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-9, abs=1e-15)


# -- LinearCost ------------------------------------------------------------------------------------
def test_prior_before_samples() -> None:
    cost = LinearCost(2e-9)
    assert cost.predict(1000) == approx(2e-6)
    assert cost.state() == {"fixed_s": 0.0, "slope": 2e-9, "prior_slope": 2e-9, "samples": 0, "regime": "prior",
                            "held": 0, "held_back": 0}


def test_regime_fixed_only_keeps_prior_slope_and_ewma_fixed() -> None:
    cost = LinearCost(1e-9)
    size, residual_s = 1_000_000, 0.004
    expected_fixed_s = 0.0
    for _ in range(10):
        cost.observe(size, size * 1e-9 + residual_s)
        expected_fixed_s += 0.2 * (residual_s - expected_fixed_s)
        assert cost.slope == 1e-9
        assert cost.fixed_s == approx(expected_fixed_s)
    assert cost.regime == "fixed_only"
    assert 0 < cost.fixed_s < residual_s
    for _ in range(60):
        cost.observe(size, size * 1e-9 + residual_s)
    assert cost.fixed_s == pytest.approx(residual_s, rel=1e-4)


def test_a_fitted_slope_survives_a_window_of_one_size() -> None:
    """Regression (session 19, the stress L3 tier on the H200): recompute learned 14 us a token from
    full prefills and restores' short tails; once every hit was restored the window held tails only,
    the fixed-only regime pulled the slope back to the 50 us prior, and restores from a storage slower
    than recompute looked worth it. A fitted slope is now what that regime keeps."""
    cost = LinearCost(50e-6)
    for _ in range(8):
        cost.observe(351, 0.0100)
        cost.observe(15, 0.0053)
    assert cost.regime == "least_squares"
    fitted = cost.slope
    assert fitted == pytest.approx((0.0100 - 0.0053) / 336, rel=1e-6)
    for _ in range(40):  # tails only: the window loses its spread
        cost.observe(15, 0.0053)
    assert cost.regime == "fixed_only"
    assert cost.slope == pytest.approx(fitted, rel=1e-9)
    assert cost.predict(15) == pytest.approx(0.0053, rel=1e-3)
    fresh = LinearCost(50e-6)  # nothing fitted yet: the prior is the reference, as before
    for _ in range(3):
        fresh.observe(15, 0.0053)
    assert fresh.slope == 50e-6


def test_regime_fixed_only_with_sizes_within_five_percent() -> None:
    cost = LinearCost(1e-9)
    for size in (1_000_000, 1_020_000, 1_040_000, 990_000):
        cost.observe(size, 0.5)  # far slower than the prior: only the fixed cost may absorb it
    assert cost.regime == "fixed_only" and cost.slope == 1e-9


def test_regime_fixed_only_faster_than_prior_lowers_slope() -> None:
    """A pessimistic prior must not survive measurements: one size, faster than the prior predicts."""
    cost = LinearCost(1e-6)
    cost.observe(1000, 4e-4)  # 2.5x faster than the prior
    assert cost.fixed_s == 0.0 and cost.slope == approx(4e-7)
    assert cost.predict(1000) == approx(4e-4)
    cost.observe(1000, 2e-3)  # slower than the prior: the slope moves back by EWMA, fixed grows
    assert cost.slope == approx(4e-7 + 0.2 * (1e-6 - 4e-7))
    assert cost.fixed_s == approx(0.2 * (2e-3 - 1e-3))
    cost.observe(1000, 5e-4)  # faster again, not the first sample: EWMA both ways
    assert cost.slope == approx(5.2e-7 + 0.2 * (5e-7 - 5.2e-7))
    assert cost.fixed_s == approx(2e-4 * 0.8)


def test_regime_least_squares_recovers_exact_line() -> None:
    cost = LinearCost(1e-9)
    fixed_s, slope = 0.003, 5e-10
    for size in (10 * MIB, 200 * MIB, 10 * MIB, 200 * MIB, 50 * MIB):
        cost.observe(size, fixed_s + size * slope)
    assert cost.regime == "least_squares"
    assert cost.fixed_s == pytest.approx(fixed_s, rel=1e-6)
    assert cost.slope == pytest.approx(slope, rel=1e-6)
    assert cost.predict(100 * MIB) == pytest.approx(fixed_s + 100 * MIB * slope, rel=1e-6)


def test_negative_slope_falls_back_to_the_reference_slope() -> None:
    """A negative fitted slope is noise: the reference slope stays, the intercept takes the mean
    (it used to fall to slope 0, and recompute looked free)."""
    cost = LinearCost(1e-5)
    cost.observe(100, 0.007)
    cost.observe(1000, 0.005)
    assert cost.regime == "least_squares"
    assert cost.slope == 1e-5 and cost.fixed_s == approx(0.006 - 1e-5 * 550)


def test_negative_intercept_falls_back_to_line_through_origin() -> None:
    cost = LinearCost(1.0)
    samples = [(100.0, 0.5), (1000.0, 9.0)]  # the free fit has intercept < 0
    for size, seconds in samples:
        cost.observe(size, seconds)
    expected_slope = sum(x * y for x, y in samples) / sum(x * x for x, _ in samples)
    assert cost.fixed_s == 0.0
    assert cost.slope == approx(expected_slope)


def test_window_of_32_forgets_old_samples() -> None:
    cost = LinearCost(1e-9)
    for size in (1 * MIB, 100 * MIB) * 16:  # 32 samples of a slow line
        cost.observe(size, 0.01 + size * 1e-8)
    assert cost.slope == pytest.approx(1e-8, rel=1e-6)
    for size in (1 * MIB, 100 * MIB) * 16:  # 32 samples of a fast line replace them all
        cost.observe(size, 0.002 + size * 2e-10)
    assert cost.num_samples == 32
    assert cost.slope == pytest.approx(2e-10, rel=1e-6)
    assert cost.fixed_s == pytest.approx(0.002, rel=1e-6)


def test_rejects_bad_samples() -> None:
    cost = LinearCost(1e-9)
    for size, seconds in ((-1, 0.1), (1, -0.1), (1, float("nan"))):
        with pytest.raises(ValueError):
            cost.observe(size, seconds)
    assert cost.num_samples == 0


# -- CostModel -------------------------------------------------------------------------------------
def model(**overrides: object) -> CostModel:
    """Decisions from the priors alone unless a test asks for storage or host-link exploration."""
    overrides.setdefault("storage_explore_reads", 0)
    overrides.setdefault("host_explore_transfers", 0)
    return CostModel(HiCacheConfig(**overrides), BYTES_PER_TOKEN)


def test_priors_in_seconds_per_byte_and_token() -> None:
    cm = model(host_bandwidth_gib_s=10.0, storage_bandwidth_gib_s=2.0, recompute_us_per_token=40.0)
    assert cm.directions["h2d"].slope == approx(1 / (10 * GIB_BYTES))
    assert cm.directions["s2h"].slope == approx(1 / (2 * GIB_BYTES))
    assert cm.recompute_cost_s(1000) == approx(0.04)
    n = 3500
    assert cm.restore_cost_s("l2", n) == approx(n * BYTES_PER_TOKEN / (10 * GIB_BYTES))
    l3_s_per_byte = 1 / (10 * GIB_BYTES) + 1 / (2 * GIB_BYTES)
    assert cm.restore_cost_s("l3", n) == approx(n * BYTES_PER_TOKEN * l3_s_per_byte)
    state = cm.state()
    assert state["directions"]["h2d"]["gib_s"] == pytest.approx(10.0)
    assert state["directions"]["recompute"]["us_per_token"] == pytest.approx(40.0)


def test_skip_l3_when_recompute_is_cheaper() -> None:
    # the reference machine: storage ~2 GiB/s, recompute 25 us/token -> a cold L3 restore loses
    cm = model(host_bandwidth_gib_s=50.0, storage_bandwidth_gib_s=2.0, recompute_us_per_token=25.0)
    decision = cm.decide(0, 0, 3500, "cost")
    assert decision.tier == "l1" and decision.restore_tokens == 0 and decision.benefit_s == 0.0
    assert decision.costs["l3_benefit_s"] < 0
    # the same hit in L2 (fast host link) is restored
    decision = cm.decide(0, 3500, 3500, "cost")
    assert decision.tier == "l2" and decision.restore_tokens == 3500 and decision.benefit_s > 0


def test_l3_restore_chosen_on_fast_storage() -> None:
    cm = model(host_bandwidth_gib_s=50.0, storage_bandwidth_gib_s=40.0, recompute_us_per_token=50.0)
    decision = cm.decide(512, 1024, 4096, "cost")
    assert decision.tier == "l3" and decision.restore_tokens == 4096 - 512
    # S2H only for the part beyond L2, H2D for everything beyond L1
    s2h = cm.directions["s2h"].predict((4096 - 1024) * BYTES_PER_TOKEN)
    h2d = cm.directions["h2d"].predict((4096 - 512) * BYTES_PER_TOKEN)
    assert decision.costs["l3_restore_s"] == approx(s2h + h2d)


def test_hits_only_count_beyond_l1() -> None:
    cm = model()
    decision = cm.decide(2048, 1024, 2048, "cost")
    assert decision.tier == "l1" and decision.costs == {}
    assert cm.decide(2048, 2048, 2048, "always").tier == "l1"


def test_margin_makes_restore_harder() -> None:
    n = 1000
    cm = model(host_bandwidth_gib_s=12.0, recompute_us_per_token=100.0)
    ratio = cm.recompute_cost_s(n) / cm.restore_cost_s("l2", n)
    assert cm.decide(0, n, 0).tier == "l2"
    stricter = model(host_bandwidth_gib_s=12.0, recompute_us_per_token=100.0, cost_margin=ratio * 1.01)
    assert stricter.decide(0, n, 0).tier == "l1"


def test_crossover_learned_from_two_sizes() -> None:
    """A large fixed H2D cost: short hits are recomputed, long hits restored."""
    cm = model(host_bandwidth_gib_s=12.0, recompute_us_per_token=25.0)
    fixed_s, slope = 0.020, 1 / (20 * GIB_BYTES)
    for num_tokens in (64, 8192) * 8:
        num_bytes = num_tokens * BYTES_PER_TOKEN
        cm.observe_transfer("h2d", num_bytes, fixed_s + num_bytes * slope)
    assert cm.directions["h2d"].fixed_s == pytest.approx(fixed_s, rel=1e-6)
    # crossover where 25e-6 * n = fixed + n * b * slope
    crossover = fixed_s / (25e-6 - BYTES_PER_TOKEN * slope)
    assert 500 < crossover < 5000
    assert cm.decide(0, int(crossover * 0.8), 0).tier == "l1"
    assert cm.decide(0, int(crossover * 1.2), 0).tier == "l2"
    # before learning, the prior (no fixed cost, 12 GiB/s) restores the short hit
    prior = model(host_bandwidth_gib_s=12.0, recompute_us_per_token=25.0)
    assert prior.decide(0, int(crossover * 0.8), 0).tier == "l2"


def test_recompute_learned_from_prefills() -> None:
    cm = model(recompute_us_per_token=50.0)
    for num_tokens in (100, 4000) * 4:
        cm.observe_prefill(num_tokens, 0.005 + num_tokens * 20e-6)
    assert cm.directions["recompute"].slope == pytest.approx(20e-6, rel=1e-6)
    assert cm.recompute_cost_s(1000) == pytest.approx(0.020, rel=1e-6)  # marginal: no fixed part


def test_write_samples_never_change_s2h() -> None:
    cm = model()
    before = cm.directions["s2h"].state()
    for num_bytes in (MIB, 64 * MIB, 3 * MIB) * 20:
        cm.observe_transfer("h2s", num_bytes, 0.05 + num_bytes * 1e-8)
    assert cm.directions["s2h"].state() == before
    assert cm.directions["h2s"].regime == "least_squares"
    assert cm.restore_cost_s("l3", 1000) == model().restore_cost_s("l3", 1000)


def test_unknown_direction_rejected() -> None:
    with pytest.raises(ValueError):
        model().observe_transfer("recompute", 10, 0.1)


def test_worth_writing() -> None:
    slow = model(host_bandwidth_gib_s=50.0, storage_bandwidth_gib_s=1.4, recompute_us_per_token=25.0)
    assert slow.worth_writing("l2", 3500)
    assert not slow.worth_writing("l3", 3500)
    fast = model(host_bandwidth_gib_s=50.0, storage_bandwidth_gib_s=40.0, recompute_us_per_token=25.0)
    assert fast.worth_writing("l3", 3500)
    assert not fast.worth_writing("l3", 0)


def test_worth_writing_ignores_fixed_cost_but_follows_learned_slope() -> None:
    cm = model(host_bandwidth_gib_s=50.0, storage_bandwidth_gib_s=40.0, recompute_us_per_token=25.0)
    for num_bytes in (MIB, 256 * MIB) * 4:  # huge fixed read cost, fast slope: still worth writing
        cm.observe_transfer("s2h", num_bytes, 1.0 + num_bytes / (40 * GIB_BYTES))
    assert cm.worth_writing("l3", 64)
    for num_bytes in (MIB, 256 * MIB) * 16:  # reads measured at 1 GiB/s: never worth it
        cm.observe_transfer("s2h", num_bytes, num_bytes / GIB_BYTES)
    assert not cm.worth_writing("l3", 1 << 20)


def test_policy_never_and_always() -> None:
    cm = model(host_bandwidth_gib_s=0.01, storage_bandwidth_gib_s=0.01)  # restores hopeless
    assert cm.decide(0, 1024, 4096, "cost").tier == "l1"
    assert cm.decide(0, 1024, 4096, "never").tier == "l1"
    always = cm.decide(0, 1024, 4096, "always")
    assert always.tier == "l3" and always.restore_tokens == 4096 and always.benefit_s < 0
    assert cm.decide(256, 1024, 1024, "always").tier == "l2"  # tie: the faster tier
    assert cm.decide(256, 2048, 1024, "always").tier == "l2"
    assert cm.decide(0, 0, 0, "always").tier == "l1"
    fast = model(recompute_us_per_token=1000.0)
    assert fast.decide(0, 1024, 4096, "never").tier == "l1"
    with pytest.raises(ValueError):
        cm.decide(0, 0, 0, "sometimes")  # type: ignore[arg-type]


def test_equal_benefit_prefers_l2() -> None:
    cm = model()
    decision = cm.decide(0, 2048, 2048, "cost")  # L3 is no candidate when L2 holds as much
    assert decision.tier == "l2" and "l3_benefit_s" not in decision.costs


def test_storage_exploration_then_learned_speed() -> None:
    """A pessimistic storage prior: the first reads are explored (L3 written and restored), then the
    measured speed decides: fast storage keeps being used, slow storage is dropped."""
    n = 350
    for measured_gib_s, used_after in ((20.0, True), (0.5, False)):
        cm = model(host_bandwidth_gib_s=50.0, storage_bandwidth_gib_s=1.0, recompute_us_per_token=25.0,
                   storage_explore_reads=2)
        assert cm.exploring_storage and cm.worth_writing("l3", n)
        decision = cm.decide(0, 0, n, "cost")
        assert decision.tier == "l3" and decision.costs["explore"] == 1.0
        for _ in range(2):
            cm.observe_transfer("s2h", n * BYTES_PER_TOKEN, n * BYTES_PER_TOKEN / (measured_gib_s * GIB_BYTES))
        assert not cm.exploring_storage
        assert cm.worth_writing("l3", n) is used_after
        assert (cm.decide(0, 0, n, "cost").tier == "l3") is used_after
    sim = model(storage_explore_reads=2)
    sim.learning = False  # simulations time nothing: no exploration either
    assert not sim.exploring_storage


def test_overlapped_h2d_is_charged_only_beyond_one_forward() -> None:
    """Regression (session 3 GPU stress run 4): the recompute intercept is learned from tail forwards that
    ran behind their layer-ordered H2D, so charging that H2D again made every short L2 restore
    look unprofitable (1.31x -> 1.02x). Behind a forward it costs only what exceeds the forward."""
    cm = model(host_bandwidth_gib_s=48.0, recompute_us_per_token=50.0)
    for _ in range(4):  # one forward: 7.5 ms over 15 tokens, 10.5 ms over 351 (H200, 8B shape)
        cm.observe_prefill(15, 7.5e-3)
        cm.observe_prefill(351, 10.5e-3)
    assert cm.directions["recompute"].fixed_s == pytest.approx(7.366e-3, rel=1e-3)
    serial = cm.decide(0, 336, 0, "cost")
    overlapped = cm.decide(0, 336, 0, "cost", overlap_h2d=True)
    assert serial.costs["l2_restore_s"] == approx(cm.restore_cost_s("l2", 336))
    assert overlapped.costs["l2_restore_s"] == 0.0 and overlapped.tier == "l2"
    # a long restore is still charged for the part the forward cannot hide
    long = cm.decide(0, 8000, 0, "cost", overlap_h2d=True)
    assert long.costs["l2_restore_s"] == approx(cm.restore_cost_s("l2", 8000) - cm.directions["recompute"].fixed_s)
    # L3 (a prefetch taken on to L1 once its bytes landed): the same credit on its H2D, none on the read
    l3_serial, l3_overlapped = cm.decide(0, 0, 336, "cost"), cm.decide(0, 0, 336, "cost", l3_taken_on=True)
    # an L3 restore started at admission reads, then copies: no credit (regression, session 18)
    assert cm.decide(0, 0, 336, "cost", overlap_h2d=True).costs["l3_restore_s"] == approx(cm.restore_cost_s("l3", 336))
    assert l3_serial.costs["l3_restore_s"] == approx(cm.restore_cost_s("l3", 336))
    assert l3_overlapped.costs["l3_restore_s"] == approx(cm.restore_cost_s("l3", 336) - cm.restore_cost_s("l2", 336))
    # part in L2 already: only the rest is read, all of it moved
    part = cm.decide(0, 160, 336, "cost", overlap_h2d=True, l3_taken_on=True).costs
    assert part["l3_restore_s"] == approx(cm._transfer_s("s2h", 176))


def test_a_tier_not_restored_from_for_a_while_is_re_timed() -> None:
    """Cost policy: after `restore_explore_every` hits in a row that a tier could have served but
    the model sent to recompute, the next such hit is restored from it (a probe), so a pessimistic
    estimate gets re-timed (regression: a trace replay's policy learned H2D at 4.5 GiB/s from its
    first five restores, all waiting behind busy streams, and never restored again;
    docs/benchmarks.md, session 16). A timed transfer of that tier restarts the count; a forced
    policy, simulations (nothing timed) and 0 never probe."""
    cm = model(host_bandwidth_gib_s=0.5, recompute_us_per_token=25.0, restore_explore_every=4)
    picks = [cm.decide(0, 3500, 3500, "cost") for _ in range(9)]
    assert [d.tier for d in picks] == ["l1", "l1", "l1", "l2", "l1", "l1", "l1", "l2", "l1"]
    assert picks[3].costs["explore"] == 1.0 and picks[3].restore_tokens == 3500 and "explore" not in picks[4].costs
    cm.decide(0, 3500, 3500, "cost")
    cm.observe_transfer("h2d", 3500 * BYTES_PER_TOKEN, 3500 * BYTES_PER_TOKEN / (0.5 * GIB_BYTES))  # still slow
    assert [cm.decide(0, 3500, 3500, "cost").tier for _ in range(4)] == ["l1", "l1", "l1", "l2"]
    fresh = model(host_bandwidth_gib_s=0.5, recompute_us_per_token=25.0, restore_explore_every=4)
    assert [fresh.decide(0, 3500, 3500, "cost").tier for _ in range(3)] == ["l1"] * 3
    fresh.observe_transfer("h2d", 3500 * BYTES_PER_TOKEN, 3500 * BYTES_PER_TOKEN / (50 * GIB_BYTES))  # a fast link
    assert [fresh.decide(0, 3500, 3500, "cost").tier for _ in range(6)] == ["l2"] * 6  # learned, not probed
    for kwargs, learning, policy in (({"restore_explore_every": 0}, True, "cost"), ({}, False, "cost"),
                                     ({}, True, "never")):
        other = model(host_bandwidth_gib_s=0.5, recompute_us_per_token=25.0, **kwargs)
        other.learning = learning
        assert all(other.decide(0, 3500, 3500, policy).tier == "l1" for _ in range(80))
    with pytest.raises(ValueError, match="explore-every"):
        HiCacheConfig(restore_explore_every=-1)


def test_a_prefetch_look_ahead_neither_counts_nor_spends_a_probe() -> None:
    """Regression (session 23): a prefetch's decision at queue time counted the hit towards a probe,
    and could take the probe, of a tier it cannot restore from: an L2 probe picked there was spent
    (the count restarted) and no L2 restore followed, and each L3 hit counted twice. A look-ahead
    leaves both to the request's admission; storage exploration (an L3 read) still applies."""
    cm = model(host_bandwidth_gib_s=0.5, recompute_us_per_token=25.0, restore_explore_every=2,
               host_explore_transfers=0)
    assert cm.decide(0, 3500, 3500, "cost").tier == "l1"  # admission of hit 1: one count
    for _ in range(3):  # hit 2's prefetch looks ahead: no count, no probe
        ahead = cm.decide(0, 3500, 3500, "cost", lookahead=True)
        assert ahead.tier == "l1" and "explore" not in ahead.costs
    probe = cm.decide(0, 3500, 3500, "cost")  # hit 2's admission: the second count, the probe
    assert probe.tier == "l2" and probe.costs["explore"] == 1.0
    untimed = model(host_bandwidth_gib_s=0.5, recompute_us_per_token=25.0, host_explore_transfers=1)
    assert untimed.decide(0, 3500, 0, "cost", lookahead=True).tier == "l1"  # not the untimed link's probe
    assert untimed.decide(0, 3500, 0, "cost").tier == "l2"
    exploring = model(storage_explore_reads=1)
    assert exploring.decide(0, 0, 3500, "cost", lookahead=True).costs["explore"] == 1.0  # an L3 read


def test_an_untimed_host_link_is_explored() -> None:
    """Regression (session 19): with the host link not yet timed a pessimistic prior (here a D2H
    dearer than the recompute it saves) must not refuse the backups and restores that would time
    it: until `host_explore_transfers` transfers each way were timed, L2 writes are admitted and an
    L2 hit the prior would recompute is restored (a probe); then the learned link decides."""
    cm = model(host_bandwidth_gib_s=1.0, recompute_us_per_token=100.0, host_explore_transfers=1)
    prior_only = model(host_bandwidth_gib_s=1.0, recompute_us_per_token=100.0)
    assert not prior_only.backup_worth_its_cost(350) and prior_only.decide(0, 350, 0).tier == "l1"
    assert cm.exploring_host and cm.backup_worth_its_cost(350) and cm.worth_writing("l2", 350)
    probe = cm.decide(0, 350, 0)
    assert probe.tier == "l2" and probe.costs["explore"] == 1.0
    cm.observe_transfer("d2h", 350 * BYTES_PER_TOKEN, 350 * BYTES_PER_TOKEN / (1.0 * GIB_BYTES))  # as slow
    assert cm.exploring_host and cm.decide(0, 350, 0).tier == "l2"  # no restore timed yet
    cm.observe_transfer("h2d", 350 * BYTES_PER_TOKEN, 350 * BYTES_PER_TOKEN / (1.0 * GIB_BYTES))
    assert not cm.exploring_host
    assert not cm.backup_worth_its_cost(350) and cm.decide(0, 350, 0).tier == "l1"
    sim = model(host_bandwidth_gib_s=1.0, recompute_us_per_token=100.0, host_explore_transfers=1)
    sim.learning = False  # simulations time nothing: no exploration
    assert not sim.exploring_host and sim.decide(0, 350, 0).tier == "l1"
    with pytest.raises(ValueError, match="host-explore-transfers"):
        HiCacheConfig(host_explore_transfers=-1)


def test_a_backup_must_cost_less_than_the_recompute_it_saves() -> None:
    """Regression (session 17, one-token pages on the H200): every stress hit backed up its one new
    token, a D2H whose fixed cost (~1.5 ms) dwarfs the ~40 us one read of that token could save."""
    cm = model(host_bandwidth_gib_s=12.0, recompute_us_per_token=50.0)
    saving_per_token_s = 50e-6 - BYTES_PER_TOKEN / (12.0 * GIB_BYTES)
    assert cm.backup_worth_its_cost(1)  # priors: no fixed cost known yet, so it is timed
    assert not cm.backup_worth_its_cost(0)
    for _ in range(8):  # one-page D2Hs of 1.5 ms
        cm.observe_transfer("d2h", BYTES_PER_TOKEN, 1.5e-3)
    fixed_s = cm.directions["d2h"].fixed_s
    assert fixed_s > 1e-3
    write_s = BYTES_PER_TOKEN / (12.0 * GIB_BYTES)  # the prior slope, kept in the fixed-only regime
    breakeven = fixed_s / (saving_per_token_s - write_s)
    assert not cm.backup_worth_its_cost(1) and not cm.backup_worth_its_cost(16)
    assert not cm.backup_worth_its_cost(int(breakeven))
    assert cm.backup_worth_its_cost(int(breakeven) + 1) and cm.backup_worth_its_cost(350)


# -- robustness: stalls, narrow spreads, starved tiers (a review of session 20) ------------------------
def _prefill_s(tokens: int) -> float:  # 5 ms a forward + 14 us a token
    return 5e-3 + 14e-6 * tokens


def test_a_lone_stall_is_held_back_and_a_confirmed_one_learned() -> None:
    cost = LinearCost(1e-6)
    for _ in range(4):
        cost.observe(1000, 1e-3)
    before = cost.state()
    cost.observe(1000, 1.0)  # a GC pause: held, nothing learned
    assert cost.state()["held"] == 1 and (cost.slope, cost.fixed_s) == (before["slope"], before["fixed_s"])
    for _ in range(CONFIRM_WITHIN + 1):  # none alike among the next CONFIRM_WITHIN: dropped
        cost.observe(1000, 1e-3)
    assert cost.held_back == 1 and cost.predict(1000) == pytest.approx(1e-3, rel=1e-6)
    cost.observe(1000, 1.0)
    cost.observe(1000, 1.0)  # two in a row: a new regime, both learned
    assert cost.state()["held"] == 0 and cost.predict(1000) > 0.1


def test_one_slow_prefill_does_not_make_recompute_dear_for_good() -> None:
    """One 20 s prefill (a compile, a pause) among normal ones became the least-squares slope, then
    the reference of a window of tails: recompute at 347 us a token, 25 x the truth, and restores from
    a 2 GiB/s storage looked worth it."""
    cm = model(storage_bandwidth_gib_s=2.0, recompute_us_per_token=50.0, storage_explore_reads=0)
    for _ in range(8):
        cm.observe_prefill(351, _prefill_s(351))
        cm.observe_prefill(15, _prefill_s(15))
    cm.observe_prefill(351, 20.0)
    for _ in range(200):
        cm.observe_prefill(15, _prefill_s(15))
    assert cm.directions["recompute"].slope == pytest.approx(14e-6, rel=1e-3)
    assert cm.decide(0, 0, 2000).tier == "l1"


def test_one_stalled_transfer_does_not_stop_restores_or_backups() -> None:
    cm = model(host_bandwidth_gib_s=12.0, recompute_us_per_token=25.0, host_explore_transfers=0)
    per_token_s = BYTES_PER_TOKEN / (40.0 * GIB_BYTES)
    for n in (256, 512, 1024, 2048) * 8:
        cm.observe_transfer("h2d", n * BYTES_PER_TOKEN, 0.5e-3 + n * per_token_s)
        cm.observe_transfer("d2h", n * BYTES_PER_TOKEN, 1.5e-3 + n * per_token_s)
    assert cm.decide(0, 1000, 0).tier == "l2" and cm.backup_worth_its_cost(512)
    cm.observe_transfer("h2d", 2048 * BYTES_PER_TOKEN, 20.0)
    cm.observe_transfer("d2h", 64 * BYTES_PER_TOKEN, 2.0)
    assert cm.decide(0, 1000, 0).tier == "l2" and cm.backup_worth_its_cost(512)


def test_refused_backups_still_time_the_link_now_and_then() -> None:
    """D2H is timed only by backups: a D2H estimate that refuses them would never be corrected."""
    cm = model(host_bandwidth_gib_s=0.01, host_explore_transfers=0, restore_explore_every=8)
    answers = [cm.backup_worth_its_cost(64) for _ in range(24)]
    assert answers.count(True) == 3 and answers[7] and answers[15] and answers[23]
    cm.observe_transfer("d2h", 64 * BYTES_PER_TOKEN, 1.0)  # a sample restarts the count
    assert [cm.backup_worth_its_cost(64) for _ in range(8)].count(True) == 1


def test_an_l3_hit_whose_l2_part_wins_is_still_re_timed() -> None:
    """_reexplore counted only hits that went to recompute: an L3 estimate that went stale was never
    re-timed while the shorter L2 part of each hit won."""
    cm = model(host_bandwidth_gib_s=50.0, storage_bandwidth_gib_s=1.0, recompute_us_per_token=25.0,
               storage_explore_reads=0, host_explore_transfers=0)
    tiers = [cm.decide(0, 160, 3500).tier for _ in range(64)]
    assert tiers.count("l3") == 2 and tiers[31] == tiers[63] == "l3"


def test_tails_of_nearly_one_size_do_not_fit_noise() -> None:
    """Tails of 16 and 18 tokens with 0.2 ms of jitter were fitted by least squares: the slope ran
    from 0 to 93 us a token and the decision for one L3 hit flipped from request to request."""
    import random

    cm = model(storage_bandwidth_gib_s=2.0, recompute_us_per_token=50.0, restore_explore_every=0,
               storage_explore_reads=0)
    rng = random.Random(1)
    slopes, tiers = set(), set()
    for i in range(300):
        n = 16 if i % 2 else 18
        cm.observe_prefill(n, max(0.0, _prefill_s(n) + rng.gauss(0, 0.2e-3)))
        slopes.add(cm.directions["recompute"].slope)
        tiers.add(cm.decide(0, 0, 2000).tier)
    assert cm.directions["recompute"].regime == "fixed_only" and len(slopes) == 1 and len(tiers) == 1
    assert slopes.pop() == pytest.approx(50e-6)


def test_a_zero_recompute_prior_is_refused() -> None:
    with pytest.raises(ValueError, match="recompute_us_per_token must be > 0"):
        model(recompute_us_per_token=0.0)

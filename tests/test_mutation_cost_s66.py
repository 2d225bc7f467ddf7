"""Rules of the online cost model (hicache/cost_model.py), its linear fit (hicache/linear_cost.py) and the reuse gate
(hicache/reuse.py) that session 66's mutation check of the three found no test watching: which timed transfer
restarts which count of refusals or probes, what the load hides under which restore, how a probe's outcome is judged,
that asks about nothing count nothing, and the edges of the fit (an outlier's confirmation window, a flat or noisy
fit, a window that lost its spread). Cost lines are set by hand (nothing is timed), so every decision asserted here
is deterministic."""
from __future__ import annotations

import pytest

from hicache.config import HiCacheConfig
from hicache.cost_model import EXPLORE_WRITES, CostModel
from hicache.linear_cost import CONFIRM_WITHIN, HOLD_AFTER_SAMPLES, LinearCost
from hicache.reuse import TierReuse
from test_mutation_cost_s56 import N, _set_lines
from test_outcomes import fast_storage_model, teach

BPT = 256  # bytes per token of the hand-set models


def _model(**config) -> CostModel:
    """A cost model whose exploration is over unless a test asks for it (nothing left to time)."""
    config.setdefault("storage_explore_reads", 0)
    config.setdefault("host_explore_transfers", 0)
    return CostModel(HiCacheConfig(**config), bytes_per_token=BPT)


# -- what a timed transfer restarts ------------------------------------------------------------------
def test_a_simulation_learns_nothing_from_its_transfers():
    """With learning off (a simulation: its copies take no time) a transfer's time is no sample: the line keeps its
    prior, and a D2H of no time would otherwise make every backup look free."""
    cost = _model()
    cost.learning = False
    before = cost.directions["d2h"].state()
    cost.observe_transfer("d2h", N * BPT, 0.0)
    assert cost.directions["d2h"].state() == before and cost.directions["d2h"].learned == 0


def test_an_h2d_timed_by_l3_restores_does_not_spend_a_charged_l2s_probe():
    """An L2 charged an end-to-end overhead loses every hit to recompute and is probed once in
    `restore_explore_every` hits. The H2Ds of L3 restores in between re-time L2's line but not its charge, which
    only L2's own restores score again: they must not restart L2's count (regression: with an L3 restore between
    any two L2 hits, an L2 whose 30 ms overhead went away was never probed again)."""
    cost = _model(restore_explore_every=4, host_bandwidth_gib_s=100.0)
    assert cost.decide(0, N, 0, lookahead=True).tier == "l2"  # on price it wins
    for _ in range(5):
        cost.observe_outcome("l2", 0.0, 1.0)
    picks = []
    for _ in range(8):
        picks.append(cost.decide(0, N, 0).tier)
        cost.observe_transfer("h2d", N * BPT, cost.directions["h2d"].predict(N * BPT))  # an L3 restore's H2D
    assert picks == ["l1", "l1", "l1", "l2"] * 2, f"a charged L2 was not probed on time: {picks}"


def test_a_timed_backup_restarts_the_count_of_refused_backups():
    """Refused backups go ahead once in `restore_explore_every` as a probe, so that the D2H line is timed again. A
    D2H timed meanwhile (another backup) does that job: the next probe comes a whole interval after it."""
    cost = _model(restore_explore_every=4)
    _set_lines(cost, recompute_us=1.0, h2d_us=0.1, d2h_us=5.0)
    assert [cost.backup_worth_its_cost(N) for _ in range(2)] == [False, False]
    cost.observe_transfer("d2h", N * BPT, cost.directions["d2h"].predict(N * BPT))
    assert [cost.backup_worth_its_cost(N) for _ in range(4)] == [False, False, False, True]


def test_an_admitted_backup_ends_the_row_of_refused_ones():
    """The backup probe comes after `restore_explore_every` refusals *in a row*: a long extension admitted on its
    price between one-token ones ends the row, so the probe is not spent early."""
    cost = _model(restore_explore_every=4)
    _set_lines(cost, recompute_us=50.0, h2d_us=3.0, d2h_us=3.0)
    cost.directions["d2h"].fixed_s = 1.5e-3  # a one-token backup costs more than it saves; 1,000 tokens pay
    assert [cost.backup_worth_its_cost(1) for _ in range(3)] == [False] * 3
    assert cost.backup_worth_its_cost(1000)
    assert [cost.backup_worth_its_cost(1) for _ in range(4)] == [False, False, False, True]


def test_backup_checks_spend_none_of_l2s_exploration_writes():
    """While no H2D has been timed, the first EXPLORE_WRITES writes to L2 go ahead whatever its price. A backup's
    own check (backup_worth_its_cost) lets it through then but does not count it: its worth_writing("l2") does, so
    each backup spends one exploration write, not two."""
    cost = _model(host_explore_transfers=1)
    _set_lines(cost, recompute_us=1.0, h2d_us=100.0, d2h_us=100.0)  # on price every L2 write is refused
    assert all(cost.backup_worth_its_cost(N) for _ in range(EXPLORE_WRITES + 8))
    assert cost.worth_writing("l2", N), "the backup checks used up the L2 writes that explore the host link"


def test_looks_at_l3_writes_count_no_refusals():
    """A look at whether L3 would take a write (probe=False: backup_pays_off asks it for every L2 backup) writes
    nothing and counts no refusal: the write probe still comes on the `restore_explore_every`-th real ask."""
    cost = _model(restore_explore_every=4)
    _set_lines(cost, recompute_us=1.0, h2d_us=0.1, s2h_us=3.0)
    assert not any(cost.worth_writing("l3", N, probe=False) for _ in range(10))
    assert [cost.worth_writing("l3", N) for _ in range(4)] == [False, False, False, True] and cost.write_probe


def test_asks_about_nothing_are_refused_and_count_nothing():
    """A write or backup of no token is refused, spends no exploration write and counts no refusal (else it could
    be let through as a probe); nothing moved costs nothing, fixed cost included; no tokens recompute for free."""
    exploring = _model(host_explore_transfers=1, storage_explore_reads=2)
    assert exploring.exploring_host and exploring.exploring_storage
    assert not exploring.worth_writing("l3", 0) and not exploring.worth_writing("l2", 0)
    assert not exploring.backup_worth_its_cost(0)
    cost = _model(restore_explore_every=2)
    assert [cost.worth_writing("l3", 0) for _ in range(4)] == [False] * 4
    assert [cost.backup_worth_its_cost(0) for _ in range(4)] == [False] * 4
    cost.directions["h2d"].fixed_s = cost.directions["s2h"].fixed_s = 1e-3
    assert cost.restore_cost_s("l2", 0) == 0.0 and cost.restore_cost_s("l3", 0) == 0.0
    assert cost.recompute_cost_s(-5) == 0.0 and cost.busy_s(-100, 0) == 0.0


# -- what the load hides, and a probe's outcome --------------------------------------------------------------
def test_an_overlapped_l2_restore_hides_behind_no_load():
    """An overlapped L2 restore's request's forward waits for the copy, and the requests queued behind wait for that
    forward: an H2D dearer than its recompute is not hidden by them (regression: their work was taken to hide it).
    The same restore not overlapped runs beside the queued work and is taken."""
    cost = _model()
    _set_lines(cost, recompute_us=1.0, h2d_us=3.0)  # (no recompute fixed cost: no overlap credit)
    assert cost.decide(0, N, 0, overlap_h2d=True, hidden_s=1.0).tier == "l1"
    assert cost.decide(0, N, 0, hidden_s=1.0).tier == "l2"


def test_an_l3_read_hides_only_behind_what_the_reads_in_flight_leave_of_the_load():
    """An L3 read queues behind the storage reads in flight: it hides only behind what they leave of the queued GPU
    work (regression: 20 requests queued together each priced the others as recomputing, and all of them parked on
    slow reads, one behind the other, while the GPU had nothing to run)."""
    cost = _model()
    _set_lines(cost, recompute_us=1.0, h2d_us=0.0, s2h_us=3.0)  # the read: 300 us; its recompute: 100 us
    assert cost.decide(0, 0, N, hidden_s=400e-6).tier == "l3"
    decision = cost.decide(0, 0, N, hidden_s=400e-6, reading_s=350e-6)
    assert decision.tier == "l1" and decision.costs["l3_benefit_s"] == pytest.approx(-150e-6)


def test_an_untimed_host_link_does_not_turn_a_winning_l3_restore_into_an_l2_one():
    """Until an H2D is timed, an L2 hit the cost policy would have *recomputed* is restored to time the link. An L3
    hit that wins on its merits stays an L3 restore (its H2D times the link too), not its shorter L2 part."""
    cost = _model(host_explore_transfers=1)
    _set_lines(cost, recompute_us=50.0, h2d_us=1.0, s2h_us=1.0)
    decision = cost.decide(0, 100, 8000)
    assert decision.tier == "l3" and decision.restore_tokens == 8000 and "explore" not in decision.costs


def test_a_probe_outcome_is_judged_against_recompute_s_own_residual():
    """A probe of a charged source whose outcome came back without the charge brings the next probe closer. The
    charge is relative to what a recompute's requests take beyond their price, and so is the probe's outcome: one
    that took just that (10 ms, all hosts' own overhead) is clean."""
    cost = fast_storage_model(restore_explore_every=4)
    teach(cost, "l1", 0.010)
    benefit_s = cost.decide(0, 0, 350, lookahead=True).benefit_s
    teach(cost, "l3", 0.010 + benefit_s + 0.001)  # charged benefit + 1 ms: recomputed
    picks = [cost.decide(0, 0, 350).tier for _ in range(4)]
    assert picks == ["l1", "l1", "l1", "l3"]  # the probe
    cost.observe_outcome("l3", 0.100, 0.110)  # as a recompute's: the charge went away
    assert cost.state()["probe_every"]["l3"] == 2
    assert [cost.decide(0, 0, 350).tier for _ in range(2)] == ["l1", "l3"]


# -- the linear fit ----------------------------------------------------------------------------------------
def _settled(window_samples: int = 32) -> LinearCost:
    """1 ms for 1,000 units, learned HOLD_AFTER_SAMPLES times: from here on outliers are held back."""
    cost = LinearCost(1e-6, window_samples=window_samples)
    for _ in range(HOLD_AFTER_SAMPLES):
        cost.observe(1000, 1e-3)
    return cost


def test_an_outlier_confirmed_on_the_last_sample_of_its_window_is_learned_with_its_confirmer():
    """A held outlier waits CONFIRM_WITHIN samples for another like it: the one that comes on the last of them
    confirms it, and both are learned (a new regime)."""
    cost = _settled()
    cost.observe(1000, 1.0)
    for _ in range(CONFIRM_WITHIN - 1):
        cost.observe(1000, 1e-3)
    cost.observe(1000, 1.0)
    assert cost.state()["held"] == 0 and cost.held_back == 0
    assert cost.learned == HOLD_AFTER_SAMPLES + CONFIRM_WITHIN - 1 + 2
    assert cost.samples()[-2:] == [(1000.0, 1.0)] * 2


def test_a_line_that_predicts_no_time_calls_no_sample_an_outlier():
    """Nothing is `OUTLIER_FACTOR` times slower than a prediction of 0 s: a line of a free prior that learned
    free samples learns the first sample that took time, rather than holding it back."""
    cost = LinearCost(0.0)
    for _ in range(HOLD_AFTER_SAMPLES):
        cost.observe(100, 0.0)
    cost.observe(100, 1e-3)
    assert cost.learned == HOLD_AFTER_SAMPLES + 1 and cost.state()["held"] == 0 and cost.predict(100) > 0


def test_a_sample_of_nothing_in_no_time_is_learned():
    """A sample of size 0 that took 0 s is no slower than the reference: it moves the fixed cost towards 0 (it must
    not take the faster-sample branch, which divides by the size)."""
    cost = LinearCost(1e-6)
    cost.observe(0, 0.0)
    assert cost.learned == 1 and cost.regime == "fixed_only" and cost.predict(0) == 0.0


def test_a_window_that_lost_its_spread_takes_a_faster_sample_outright():
    """A window whose sizes stopped differing (a recompute line that sees only restores' short tails) prices
    against the last fitted slope; a sample faster than that slope predicts shows it pessimistic, and is taken
    outright on the regime's first sample, coming from a least-squares fit as from the prior."""
    cost = LinearCost(1e-6, window_samples=4)
    for size in (100, 1000, 100, 1000):
        cost.observe(size, 1e-3 + size * 1e-5)
    assert cost.regime == "least_squares" and cost.reference_slope == pytest.approx(1e-5)
    for _ in range(2):
        cost.observe(1000, 2e-3)
    assert cost.regime == "least_squares"  # (a 100 still in the window)
    cost.observe(1000, 2e-3)
    assert cost.regime == "fixed_only"
    assert cost.fixed_s == 0.0 and cost.predict(1000) == pytest.approx(2e-3)


def test_a_noisy_fit_never_gets_a_negative_fixed_cost():
    """A negative fitted slope falls back to the reference slope, and the intercept to the mean seconds beyond it,
    but never below 0 (a negative fixed cost would price short transfers below nothing)."""
    cost = LinearCost(1e-3)
    cost.observe(10, 0.005)
    cost.observe(1000, 0.004)
    assert cost.regime == "least_squares" and cost.slope == 1e-3
    assert cost.fixed_s == 0.0 and cost.predict(10) > 0


def test_a_flat_fit_does_not_become_the_reference():
    """A fit of slope 0 (every size took the same time) is no reference for later windows of one size, nor for the
    next engine (reference_slopes is kept with a kept L3 index): it would price every size alike."""
    cost = LinearCost(1e-5)
    for size in (100, 1000, 100, 1000):
        cost.observe(size, 5e-3)
    assert cost.regime == "least_squares" and cost.slope == 0.0
    assert cost.reference_slope == 1e-5


# -- the reuse gate ----------------------------------------------------------------------------------------
def test_a_tier_that_reads_back_exactly_its_fraction_is_productive():
    reuse = TierReuse(min_evicted_pages=64, window_pages=1024, min_read_fraction=0.25, probe_every=16)
    reuse.on_evicted(100)
    reuse.on_read(25)
    assert reuse.productive and all(reuse.admit() for _ in range(20))

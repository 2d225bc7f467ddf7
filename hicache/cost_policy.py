"""The cost policy's questions: restore or recompute a prefix, write it to a lower tier or not, how
much of a layer-ordered restore goes first, whole. `CostPolicy` answers them for one CacheManager
(which delegates its methods of the same names here) from the cost model's timed lines
(hicache/cost_model.py), the tiers' observed reuse (hicache/reuse.py) and the policy configured
("cost" asks both; "always" / "never" decide alone). It moves no page and changes no residency: its
only effects are counters (metrics.policy_skips, the reuse gates' probes) and what the cost model
learns. So where the cost model raises (a bug, a line gone wrong) as it decides or learns for a request,
that request recomputes its prefix and the sample is dropped (`failures.cost_model`, a `cost_model_failed`
error line): recompute is always right (regression: the error went out of admission, or out of the step
that timed a prefill, crashed the engine loop, and every live request failed with it). Where it raises as
it admits a write, the write is refused, and as it splits a layer-ordered restore, the restore goes all in
layers, both counted so (regression: out of write_through_selective's backup at a hit, or write_back's
eviction veto, it crashed the engine loop; out of the backups started after a step, those after it were
dropped, uncounted).

Everything is read from the manager when asked, never copied at construction: the engine sets
`busy_s` and `overlap_forward_s` on the manager as it runs, and tests swap its reuse gates.
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import structlog

from hicache.cost_model import Decision
from hicache.log_gate import log_anyway
from hicache.radix import MatchResult, Tier

if TYPE_CHECKING:
    from hicache.manager import CacheManager

# A layer-ordered restore keeps this much more than its forward's time in layers (whole_first_pages):
# a forward left waiting for whole pages costs all its time, a page too many in layers ~10 % of its copy
OVERLAP_MARGIN = 1.25

log = structlog.get_logger("hicache.cost")


def _failed(mgr: "CacheManager", call: str) -> None:
    """The cost model raised in `call`: counted and logged; the caller goes on with the safe answer."""
    mgr.metrics.count_failure("cost_model")
    log_anyway(log.exception, "cost_model_failed", call=call)


def observe_transfer(mgr: "CacheManager", direction: str, num_bytes: int, seconds: float) -> None:
    """A copy's or an L3 read's / write's time learned (`CostModel.observe_transfer`, from the op runner's waits);
    where the cost model raises, the sample is dropped (`_failed`) and the op that timed it ends as its copy did
    (regression: a D2H or H2D that had landed failed as a `transfer` failure, its pages thrown away, an L3 write or
    read as a driver bug)."""
    try:
        mgr.cost.observe_transfer(direction, num_bytes, seconds)
    except Exception:
        _failed(mgr, "observe_transfer")


def _guarded(safe_answer):
    """A CostPolicy method whose raise is `_failed` (counted, logged) and answers `safe_answer` instead: no
    write, a restore all in layers, a sample dropped (see the module docstring)."""
    def guard(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception:
                _failed(self.mgr, method.__name__)
                return safe_answer
        return guarded
    return guard


class CostPolicy:
    def __init__(self, mgr: "CacheManager") -> None:
        self.mgr = mgr

    # -- restores ------------------------------------------------------------------------------
    @_guarded(0)  # (all in layers)
    def whole_first_pages(self, num_pages: int, tail_tokens: int = 0) -> int:
        """How many of a layer-ordered restore's `num_pages` go first, whole (the pipelined DMA and
        scatter, at the pinned copy's rate, before its forward has anything to do; 2-D DMAs beside
        a running forward lose 8-12 % of it, docs/benchmarks.md session 21): all but what the H2D
        moves while that forward runs, at the rate restores of this length were timed at (with a
        margin). The forward: the timed tail graph plus the recompute model's marginal cost of the
        tail's `tail_tokens` (its intercept is no guide: it learns from overlapped forwards, whose
        time includes their restore's). 0 (all in layers) until the forward and the H2D were both
        timed."""
        mgr = self.mgr
        h2d, num_bytes = mgr.cost.directions["h2d"], num_pages * mgr.geometry.bytes_per_page
        if not (mgr.config.whole_first and mgr.overlap_forward_s) or num_pages <= 0 or h2d.num_samples == 0:
            return 0
        seconds = h2d.predict(num_bytes)
        if seconds <= 0:
            return 0
        forward_s = mgr.overlap_forward_s + max(0, tail_tokens) * mgr.cost.directions["recompute"].slope
        layered_bytes = OVERLAP_MARGIN * forward_s * num_bytes / seconds
        return max(0, num_pages - math.ceil(layered_bytes / mgr.geometry.bytes_per_page))

    def decide(self, match: MatchResult, overlap_h2d: bool = False, l3_taken_on: bool = False,
               lookahead: bool = False, hidden_s: float = 0.0, count_skip: bool = True,
               prompt_tokens: int = 0, chunk_tokens: int = 0) -> Decision:
        """overlap_h2d: the caller would run the tail forward behind a layer-ordered L2 restore; l3_taken_on:
        behind an L3 prefetch taken on to L1; lookahead: a prefetch's decision at queue time, which counts no
        probe and no policy skip; hidden_s: GPU work queued besides the request, which its restore would run
        beside; prompt_tokens, chunk_tokens (max_prefill_tokens): count each option's forwards (CostModel.decide);
        count_skip=False: the caller counts the policy skip (`declines_restore`) itself (the engine: once per
        request, as it is admitted, though one waiting for memory is decided again on every loop turn)."""
        mgr = self.mgr
        l1, l2, l3 = match.lengths
        policy = mgr.config.policy if mgr.has_l2 else "never"
        try:
            # (an L3 read queues behind the storage reads in flight: what they take hides nothing for it)
            reading_s = mgr.runner.reading_s() if hidden_s > 0 else 0.0
            decision = mgr.cost.decide(l1, l2 if mgr.has_l2 else 0, l3 if mgr.has_l3 else 0, policy, overlap_h2d,
                                       l3_taken_on, lookahead, hidden_s, reading_s, prompt_tokens, chunk_tokens)
        except Exception:
            _failed(mgr, "decide")
            decision = Decision(tier="l1", restore_tokens=0, benefit_s=0.0, costs={}, failed=True)
        if count_skip and not lookahead and self.declines_restore(match, decision):
            mgr.metrics.policy_skips["restore"] += 1
        return decision

    def declines_restore(self, match: MatchResult, decision: Decision) -> bool:
        """The policy recomputes what a lower tier holds beyond L1 (a restore policy skip; not a decision that failed,
        counted as `failures.cost_model`)."""
        l1, l2, l3 = match.lengths
        return (decision.tier == "l1" and not decision.failed and max(l2, l3) > l1 and self.mgr.has_l2
                and self.mgr.config.policy != "never")

    # -- writes (backups to L2, L3) ------------------------------------------------------------
    @_guarded(False)
    def worth_writing(self, tier: str, num_tokens: int) -> bool:
        """Write admission by cost: a forced policy decides alone ("always" writes, "never" does not);
        "cost" writes only where a restore can beat recompute for this length, beside the GPU work
        queued now (`busy_s`). Whether writes to a tier get read back at all is the other gate:
        backup_pays_off / l3_write_pays_off."""
        mgr = self.mgr
        if mgr.config.policy != "cost":
            return mgr.config.policy == "always"
        return mgr.cost.worth_writing(tier, num_tokens, hidden_s=mgr.busy_s, reading_s=mgr.runner.reading_s())

    @_guarded(False)
    def backup_worth_its_cost(self, new_tokens: int) -> bool:
        """Cost policy: is a backup of this many new tokens cheaper than one recompute of them
        (CostModel.backup_worth_its_cost)? Yes too while the storage speed is being explored: L3 is
        written through L2, and something must be read back to time it (CostModel.exploring_writes: a few).
        Forced policies decide alone."""
        mgr = self.mgr
        return (mgr.config.policy != "cost" or mgr.cost.backup_worth_its_cost(new_tokens)
                or (mgr.has_l3 and mgr.cost.exploring_writes("l3", count=False)))  # (its L3 write counts)

    def l3_write_pays_off(self) -> bool:
        """Cost policy: L3 writes go on while L3 gets read back (or has not evicted enough to tell)."""
        return self.mgr.config.policy != "cost" or self.mgr.reuse[Tier.L3].admit()

    def l3_reuse_probe(self) -> bool:
        """Cost policy, an L3 write asked for where L2's checks refused its backup
        (`Backups._l3_write_probe`): is it the probe of an unproductive L3's reuse gate? Counted as
        l3_write_pays_off counts, so that the probe comes once in `probe_every` L3 write asks, not
        once in `probe_every` of those L2 lets through (regression: once in 16 * 16 behind an L2
        not read back). A productive L3 lets no refused backup through here: backup_pays_off
        already takes the backups it wants."""
        l3 = self.mgr.reuse[Tier.L3]
        return self.mgr.config.policy == "cost" and not l3.productive and l3.admit()

    @_guarded(False)
    def backup_pays_off(self, num_tokens: int) -> bool:
        """Cost policy: is an L1 -> L2 backup of this prefix worth its traffic? Yes while L2 gets read
        back, or while it feeds an L3 worth writing that gets read back; otherwise only as a probe."""
        mgr = self.mgr
        if mgr.config.policy != "cost":
            return True
        l3_wants_it = (mgr.has_l3 and mgr.cost.worth_writing("l3", num_tokens, probe=False, hidden_s=mgr.busy_s,
                                                             reading_s=mgr.runner.reading_s())
                       and mgr.reuse[Tier.L3].productive)
        if l3_wants_it:
            return True
        l2 = mgr.reuse[Tier.L2]
        # a backup's D2H competes with the GPU's own work: it pays once enough of what is written
        # is read back to save more recompute than the writes cost (L3 writes run on I/O threads
        # beside the GPU and keep the fixed 1 % floor)
        l2.min_read_fraction = mgr.cost.break_even_read_fraction()
        return l2.admit()

    # -- learning ------------------------------------------------------------------------------
    @_guarded(None)
    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            self.mgr.cost.observe_prefill(num_tokens, seconds)

    @_guarded(None)
    def observe_outcome(self, source: str, plan: tuple, actual_s: float) -> None:
        """A request that ran alone took `actual_s` from arrival to its first token, its prefix from
        `source`, planned as `plan` = (Decision.priced or (), uncached tokens): priced now
        (CostModel.span_s) and learned (hicache/outcomes.py)."""
        mgr = self.mgr
        if mgr.has_l2 and mgr.config.policy == "cost":
            mgr.cost.observe_outcome(source, mgr.cost.span_s(source, *plan), actual_s)

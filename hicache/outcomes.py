"""What a request's prefix source really cost, end to end, against what the cost model predicted.

The cost model prices a restore by its transfers (storage read, H2D) and a recompute by the
prefill's fitted line. Neither sees the rest of a source's path: for an L3 hit the park and
wake-up around the read, the take-on to L1, the checksums that gate the forward's output, the loop
turns in between. On the H200 a 350-token L3 restore and its recompute cost about the same, so
such an overhead decides which is faster: a model blind to it restored 69 of 72 L3 hits of a run
that was then 7 % slower than recomputing (stress L3, 0.93 x hicache off, session 21).

So each request that ran alone (exactly one batch ended between its arrival and its first token:
its own, of one sequence; a chunked prefill is never scored) is scored once: `actual_s` (arrival to the first token's forward end) minus `predicted_s` (what
the model prices the path it took at, then: the restore's price plus the tail's prefill, or the
whole uncached prefill; `CostModel.span_s`). The residual's median over the last OUTCOME_WINDOW requests, per source
("l1": recomputed, "l2", "l3"), is that source's unpriced overhead; `CostModel.decide` charges a
restore the difference between its source's and recompute's (the loop's own host time, in both,
cancels out; before any recompute was scored, its source's whole residual).

The residual is seconds per request, not per byte: it is what the transfer lines miss, and taking
it as a rate would scale a 350-token overhead up to an 8,000-token hit that it does not decide.
"""
from __future__ import annotations

import math
import statistics
from collections import deque

OUTCOME_SOURCES = ("l1", "l2", "l3")
OUTCOME_WINDOW = 16  # requests per source: the median of a window shrugs off a GC pause or a JIT compile
MIN_OUTCOMES = 5  # a source's residual counts once this many were scored (a median of 5 outlasts 2 compiles)


class OutcomeResiduals:
    """Per source, the last `window` residuals (actual - predicted seconds) of requests that ran alone."""

    def __init__(self, window: int = OUTCOME_WINDOW, min_samples: int = MIN_OUTCOMES) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got {window}, {min_samples}")
        self.min_samples = min_samples
        self._residuals = {source: deque(maxlen=window) for source in OUTCOME_SOURCES}

    def observe(self, source: str, predicted_s: float, actual_s: float) -> None:
        if source not in OUTCOME_SOURCES:
            raise ValueError(f"unknown prefix source {source!r}; expected one of {OUTCOME_SOURCES}")
        if not (math.isfinite(predicted_s) and math.isfinite(actual_s)) or predicted_s < 0 or actual_s < 0:
            raise ValueError(f"outcome times must be finite and >= 0, got predicted={predicted_s} actual={actual_s}")
        self._residuals[source].append(actual_s - predicted_s)

    def residual_s(self, source: str) -> float | None:
        """Median residual of `source`, None until it has min_samples."""
        window = self._residuals[source]
        return statistics.median(window) if len(window) >= self.min_samples else None

    def extra_s(self, source: str) -> float:
        """Seconds a restore from `source` costs beyond its priced transfers, relative to a
        recompute's own residual once that is known (until then all of it: a workload whose every
        hit is restored may never score a recompute); 0 until the source's own is known."""
        own, recompute = self.residual_s(source), self.residual_s("l1")
        if own is None:
            return 0.0
        return own - (recompute or 0.0)

    def state(self) -> dict:
        return {source: {"samples": len(window), "residual_s": self.residual_s(source)}
                for source, window in self._residuals.items()}

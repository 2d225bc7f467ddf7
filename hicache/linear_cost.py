"""One direction of the cost model (hicache/cost_model.py): `seconds = fixed_s + size * slope`, an
online linear fit over a window of recent samples, with one-off stalls held back until another
sample confirms them."""
from __future__ import annotations

import math
from collections import deque

WINDOW_SAMPLES = 32
EWMA_ALPHA = 0.2
# A sample this many times slower than predicted is held back until another one confirms it within
# CONFIRM_WITHIN samples: one stall (a GC pause, a JIT compile, a preempted thread) would otherwise
# sit in the window for 32 samples, or, as a fitted slope, for good.
OUTLIER_FACTOR = 8.0
CONFIRM_WITHIN = 8
HOLD_AFTER_SAMPLES = 4  # before, the fit is too young to call anything an outlier
# Sizes must span this fraction of the largest before slope and intercept are fitted apart: a
# narrower spread (tails of 16 and 18 tokens) fits noise.
MIN_SPREAD_FRACTION = 1 / 3


class LinearCost:
    """`seconds = fixed_s + size * slope`, fitted over a window of recent (size, seconds) samples.

    Regime "prior": no samples yet, slope = prior, fixed_s = 0.
    Once HOLD_AFTER_SAMPLES were learned (before, a prior with no fixed cost, or a fixed cost one
    EWMA step old, would call ordinary samples outliers), a sample more than OUTLIER_FACTOR times
    slower than the prediction is held back, and learned only if another such sample comes within
    CONFIRM_WITHIN samples (a new regime: both are).
    Regime "fixed_only": the sizes in the window barely differ (max - min <= max(1, a third of max)), so
    slope and intercept cannot both be identified. A sample slower than the reference slope predicts
    moves, by EWMA (alpha 0.2), the slope towards the reference and fixed_s towards the excess,
    seconds - size * reference (DESIGN.md section 7). The reference is the prior until a window of several sizes
    identified a slope, then the last such fit no one sample decided: a window that has lost its spread (a recompute
    model that sees only restores' short tails once every hit is restored) would otherwise drift
    back to the prior and forget what it measured (session 19: the stress L3 tier's recompute
    slope went back to the prior's 50 us a token, 3.6 x the 14 it had fitted, and every hit was
    restored from a storage slower than recompute). A faster sample means the reference is
    pessimistic: fixed_s moves towards 0 and the slope towards seconds / size, outright on the regime's first sample (an optimistic estimate
    gets re-measured as it is used; a pessimistic one would stop the very restores that could
    correct it), by EWMA after that.
    Regime "least_squares": fit both, constrained to fixed_s >= 0 and slope >= 0. A negative slope
    (noise) falls back to the reference slope with fixed_s = max(0, mean seconds - reference * mean
    size); a negative intercept to a line through the origin (fixed_s = 0, slope = sum(x*y) / sum(x*x)).
    """

    def __init__(self, prior_slope: float, *, window_samples: int = WINDOW_SAMPLES,
                 ewma_alpha: float = EWMA_ALPHA) -> None:
        if not (math.isfinite(prior_slope) and prior_slope >= 0):
            raise ValueError(f"prior slope must be finite and >= 0, got {prior_slope}")
        if window_samples < 1 or not 0 < ewma_alpha <= 1:
            raise ValueError("window_samples must be >= 1 and 0 < ewma_alpha <= 1")
        self.prior_slope = prior_slope
        self.ewma_alpha = ewma_alpha
        self.fixed_s = 0.0
        self.slope = prior_slope
        self.reference_slope = prior_slope  # the fixed-only regime's slope: the prior, or the last fit's
        self.regime = "prior"
        self._samples: deque[tuple[float, float]] = deque(maxlen=window_samples)
        self._held: deque[tuple[int, float, float]] = deque()  # (sample number, size, seconds) outliers
        self._seen = 0  # samples offered
        self.learned = 0  # samples learned, not capped by the window (the exploration counts' measure)
        self.held_back = 0  # outliers never confirmed (state())

    def observe(self, size: float, seconds: float) -> None:
        if not (math.isfinite(size) and math.isfinite(seconds)) or size < 0 or seconds < 0:
            raise ValueError(f"cost sample must be finite and >= 0, got size={size} seconds={seconds}")
        self._seen += 1
        while self._held and self._held[0][0] < self._seen - CONFIRM_WITHIN:
            self._held.popleft()
            self.held_back += 1
        predicted = self.predict(size)
        if len(self._samples) >= HOLD_AFTER_SAMPLES and predicted > 0 and seconds > OUTLIER_FACTOR * predicted:
            if not self._held:
                self._held.append((self._seen, float(size), float(seconds)))
                return
            confirmed = [(x, y) for _, x, y in self._held]  # a second one: a new regime, learn them all
            self._held.clear()
            for x, y in confirmed:
                self._learn(x, y)
        self._learn(float(size), float(seconds))

    def _learn(self, size: float, seconds: float) -> None:
        self.learned += 1
        self._samples.append((size, seconds))
        sizes = [x for x, _ in self._samples]
        largest = max(sizes)
        if largest - min(sizes) <= max(1.0, MIN_SPREAD_FRACTION * largest):
            self._observe_fixed_only(size, seconds)
        else:
            self._fit_least_squares()

    def _observe_fixed_only(self, size: float, seconds: float) -> None:
        first = self.regime != "fixed_only"
        self.regime = "fixed_only"
        reference = self.reference_slope
        if seconds >= size * reference:
            target_slope, target_fixed_s, alpha = reference, seconds - size * reference, self.ewma_alpha
        else:  # size > 0 here (0 * reference <= seconds)
            target_slope, target_fixed_s, alpha = seconds / size, 0.0, 1.0 if first else self.ewma_alpha
        self.slope += alpha * (target_slope - self.slope)
        self.fixed_s += alpha * (target_fixed_s - self.fixed_s)

    def _fit_least_squares(self) -> None:
        self.regime = "least_squares"
        n = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        sxx = sum((x - mean_x) ** 2 for x, _ in self._samples)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in self._samples)
        slope = sxy / sxx  # sxx > 0: the spread exceeded the fixed-only threshold
        fixed_s = mean_y - slope * mean_x
        if slope < 0:
            self.fixed_s, self.slope = max(0.0, mean_y - self.reference_slope * mean_x), self.reference_slope
        elif fixed_s < 0:
            sum_xy = sum(x * y for x, y in self._samples)
            sum_xx = sum(x * x for x, _ in self._samples)
            self.fixed_s, self.slope = 0.0, max(0.0, sum_xy / sum_xx)
        else:
            self.fixed_s, self.slope = fixed_s, slope
        sizes = [x for x, _ in self._samples]
        lo, hi = min(sizes), max(sizes)
        thr = max(1.0, MIN_SPREAD_FRACTION * hi)
        supported = min(sum(x - lo > thr for x in sizes), sum(hi - x > thr for x in sizes)) >= 2
        # a reference (what later outliers are held back against) only from a fit with two samples
        # at each end of the spread (regression: one slow sample at another size, a GC pause, set
        # the slope alone and stayed the reference: recompute learned at 162 us/token, not 14), and
        # that no one sample decides: leaving out any keeps the slope within a factor of 2 (regression: one
        # of the last two full prefills before a window of tails only, 5 x slow, set it at 5.2 x for good)
        k = n / (n - 1)
        steady = slope > 0 and all(
            0 < slope * (sxx - k * (x - mean_x) ** 2) / 2 <= sxy - k * (x - mean_x) * (y - mean_y)
            <= 2 * slope * (sxx - k * (x - mean_x) ** 2) for x, y in self._samples)
        if self.slope > 0 and supported and steady:
            self.reference_slope = self.slope

    def predict(self, size: float) -> float:
        """Seconds for one operation of `size` units (fixed cost included)."""
        return self.fixed_s + size * self.slope

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def samples(self) -> list[tuple[float, float]]:
        """The window's (size, seconds) samples, oldest first: what an engine restarted on a kept L3 file learns
        again (hicache/l3_index.py)."""
        return list(self._samples)

    def state(self) -> dict:
        return {"fixed_s": self.fixed_s, "slope": self.slope, "prior_slope": self.prior_slope,
                "samples": len(self._samples), "regime": self.regime, "held": len(self._held),
                "held_back": self.held_back}

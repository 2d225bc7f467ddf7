"""What the cost model (hicache/cost_model.py) keeps across engines, mixed into CostModel: each direction's window of
samples and reference slope, saved with a kept L3 file's index (hicache/l3_index.py) and learned again by the next
engine on the same machine, so that its first restore-or-recompute decisions are priced as the last engine's last ones
were. Uses the CostModel's `directions` (LinearCost by name) and `learning`."""
from __future__ import annotations

from hicache.linear_cost import WINDOW_SAMPLES

# a sample learned again (`learn_again`) is at most this: a size (bytes, tokens) a float holds exactly, an hour
SAMPLE_SIZE_MAX, SAMPLE_SECONDS_MAX = float(1 << 53), 3600.0


class CostMemory:
    def samples(self) -> dict[str, list[tuple[float, float]]]:
        """Each direction's window of samples (LinearCost.samples), by name."""
        return {name: cost.samples() for name, cost in self.directions.items()}

    def reference_slopes(self) -> dict[str, float]:
        """Each direction's reference slope (LinearCost.reference_slope: the last fit a window of several sizes
        identified), kept with the samples: a window of one size prices against it."""
        return {name: cost.reference_slope for name, cost in self.directions.items()}

    def learn_again(self, samples: dict, references: dict | None = None) -> int:
        """Learn `samples` (a `samples()` of an earlier engine on this machine, as its kept L3 index carries it:
        hicache/l3_index.py) in order, as if just timed, against that engine's `references` (`reference_slopes`;
        regression: a recompute window of restores' short tails alone went back to the prior's 50 us a token, not
        the 14 fitted before the restart, and restored from a storage slower than recompute); returns how many.
        Malformed input (an unknown direction, a sample not two numbers in [0, SAMPLE_SIZE_MAX] and
        [0, SAMPLE_SECONDS_MAX], a reference not a number in [0, SAMPLE_SECONDS_MAX]) raises ValueError before
        anything is learned (regression: an integer past a float's range, or a size of 1e300 whose fit
        overflowed, raised OverflowError and stopped the engine's start; an hour-long sample priced a tier out)."""
        slopes: dict[str, float] = {}
        for name, slope in (references or {}).items():
            if name not in self.directions or not (isinstance(slope, (int, float)) and not isinstance(slope, bool)
                                                   and 0 <= slope <= SAMPLE_SECONDS_MAX):
                raise ValueError(f"no reference slope of a cost direction: {name!r}: {str(slope)[:40]}")
            slopes[name] = float(slope)
        checked: dict[str, list[tuple[float, float]]] = {}
        for name, rows in samples.items():
            if name not in self.directions or not isinstance(rows, list):
                raise ValueError(f"no cost direction {name!r} with a list of samples")
            pairs = []
            for row in rows[-WINDOW_SAMPLES:]:
                if not (isinstance(row, (list, tuple)) and len(row) == 2
                        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row)
                        and 0 <= row[0] <= SAMPLE_SIZE_MAX and 0 <= row[1] <= SAMPLE_SECONDS_MAX):  # (NaN: False)
                    raise ValueError(f"a {name} sample is not (size, seconds) in [0, {SAMPLE_SIZE_MAX:g}] x "
                                     f"[0, {SAMPLE_SECONDS_MAX:g}]: {str(row)[:80]}")
                pairs.append((float(row[0]), float(row[1])))
            checked[name] = pairs
        if not self.learning:
            return 0
        for name, slope in slopes.items():
            self.directions[name].reference_slope = slope
        for name, pairs in checked.items():
            for size, seconds in pairs:
                self.directions[name].observe(size, seconds)
        return sum(len(pairs) for pairs in checked.values())

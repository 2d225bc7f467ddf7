"""Fault injection for tests and soak runs: zero cost when off.

Code that can fail takes `faults: FaultInjector | None` and tests
`if faults is not None and faults.should_fire(Fault.X): ...`; there is nothing global.
A FaultInjector is thread-safe: it is consulted from I/O worker threads.
"""
from __future__ import annotations

import enum
import random
import threading
from dataclasses import dataclass


class Fault(enum.Enum):
    EIO_READ = "eio_read"  # a file read fails with EIO
    EIO_WRITE = "eio_write"  # a file write fails with EIO
    SHORT_READ = "short_read"  # a read transfers half an extent, then hits EOF
    SHORT_WRITE = "short_write"  # a write transfers half an extent, then accepts nothing
    ENOSPC_WRITE = "enospc_write"  # a file write fails with ENOSPC
    SLOW_READ = "slow_read"  # a read worker sleeps delay_s before reading
    SLOW_VERIFY = "slow_verify"  # a read's checksum job sleeps delay_s before hashing (the bytes landed)
    TRANSFER_RAISE = "transfer_raise"  # a device/host transfer whose completion raises


@dataclass
class _Arm:
    times_left: int | None  # None: unlimited
    probability: float
    rng: random.Random


class FaultInjector:
    """Per-fault arming with a count, a probability (own seeded RNG) and an optional delay."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[Fault, _Arm] = {}
        self._delays_s: dict[Fault, float] = {}
        self._fired: dict[Fault, int] = {f: 0 for f in Fault}

    def arm(
        self,
        fault: Fault,
        *,
        times: int | None = 1,
        probability: float = 1.0,
        delay_s: float = 0.0,
        seed: int = 0,
    ) -> None:
        """Arm `fault` to fire `times` more times (None: until disarmed), each check firing with
        `probability`. Re-arming replaces the previous arming of that fault."""
        if not isinstance(fault, Fault):
            raise TypeError(f"not a Fault: {fault!r}")
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1 or None, got {times}")
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {probability}")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        with self._lock:
            self._armed[fault] = _Arm(times, float(probability), random.Random(seed))
            self._delays_s[fault] = float(delay_s)

    def disarm(self, fault: Fault | None = None) -> None:
        """Disarm one fault, or all of them (fired counts are kept)."""
        with self._lock:
            if fault is None:
                self._armed.clear()
                self._delays_s.clear()
            else:
                self._armed.pop(fault, None)
                self._delays_s.pop(fault, None)

    def should_fire(self, fault: Fault) -> bool:
        """True when an armed fault fires now; consumes one of its `times`."""
        with self._lock:
            arm = self._armed.get(fault)
            if arm is None:
                return False
            if arm.probability < 1.0 and arm.rng.random() >= arm.probability:
                return False
            if arm.times_left is not None:
                arm.times_left -= 1
                if arm.times_left <= 0:
                    del self._armed[fault]
            self._fired[fault] += 1
            return True

    def delay_s(self, fault: Fault) -> float:
        """The delay given when `fault` was last armed (kept after its times are used up)."""
        with self._lock:
            return self._delays_s.get(fault, 0.0)

    def is_armed(self, fault: Fault) -> bool:
        with self._lock:
            return fault in self._armed

    def remaining(self, fault: Fault) -> int | None:
        """Times left (None: unlimited or not armed; see is_armed)."""
        with self._lock:
            arm = self._armed.get(fault)
            return None if arm is None else arm.times_left

    @property
    def fired(self) -> dict[Fault, int]:
        """Snapshot of how many times each fault has fired."""
        with self._lock:
            return dict(self._fired)

    def __repr__(self) -> str:
        with self._lock:
            armed = {f.value: a.times_left for f, a in self._armed.items()}
            fired = {f.value: n for f, n in self._fired.items() if n}
        return f"FaultInjector(armed={armed}, fired={fired})"

"""Unit tests of hicache.faults.FaultInjector."""
from __future__ import annotations

import threading

import pytest

from hicache.faults import Fault, FaultInjector


def test_unarmed_never_fires():
    faults = FaultInjector()
    assert not any(faults.should_fire(f) for f in Fault)
    assert all(n == 0 for n in faults.fired.values())
    assert set(faults.fired) == set(Fault)


def test_times_counts_down_then_disarms():
    faults = FaultInjector()
    faults.arm(Fault.EIO_READ, times=2)
    assert faults.is_armed(Fault.EIO_READ) and faults.remaining(Fault.EIO_READ) == 2
    assert faults.should_fire(Fault.EIO_READ)
    assert not faults.should_fire(Fault.EIO_WRITE)  # other faults unaffected
    assert faults.should_fire(Fault.EIO_READ)
    assert not faults.should_fire(Fault.EIO_READ)
    assert not faults.is_armed(Fault.EIO_READ)
    assert faults.fired[Fault.EIO_READ] == 2 and faults.fired[Fault.EIO_WRITE] == 0


def test_unlimited_until_disarmed():
    faults = FaultInjector()
    faults.arm(Fault.SHORT_WRITE, times=None)
    assert all(faults.should_fire(Fault.SHORT_WRITE) for _ in range(50))
    faults.disarm(Fault.SHORT_WRITE)
    assert not faults.should_fire(Fault.SHORT_WRITE)
    assert faults.fired[Fault.SHORT_WRITE] == 50


def test_disarm_all_keeps_counts():
    faults = FaultInjector()
    faults.arm(Fault.EIO_READ, times=None)
    faults.arm(Fault.ENOSPC_WRITE, times=None)
    assert faults.should_fire(Fault.EIO_READ)
    faults.disarm()
    assert not faults.should_fire(Fault.EIO_READ) and not faults.should_fire(Fault.ENOSPC_WRITE)
    assert faults.fired[Fault.EIO_READ] == 1


def test_probability_is_seeded_and_deterministic():
    def pattern(seed: int) -> list[bool]:
        faults = FaultInjector()
        faults.arm(Fault.TRANSFER_RAISE, times=None, probability=0.3, seed=seed)
        return [faults.should_fire(Fault.TRANSFER_RAISE) for _ in range(400)]

    a, b, c = pattern(1), pattern(1), pattern(2)
    assert a == b and a != c
    assert 60 < sum(a) < 180  # roughly 30%


def test_probability_zero_never_consumes_times():
    faults = FaultInjector()
    faults.arm(Fault.EIO_READ, times=1, probability=0.0)
    assert not any(faults.should_fire(Fault.EIO_READ) for _ in range(100))
    assert faults.remaining(Fault.EIO_READ) == 1


def test_delay_kept_after_times_used_up():
    faults = FaultInjector()
    faults.arm(Fault.SLOW_READ, times=1, delay_s=0.25)
    assert faults.should_fire(Fault.SLOW_READ)
    assert faults.delay_s(Fault.SLOW_READ) == 0.25
    assert faults.delay_s(Fault.EIO_READ) == 0.0


def test_rearm_replaces():
    faults = FaultInjector()
    faults.arm(Fault.EIO_WRITE, times=5)
    faults.arm(Fault.EIO_WRITE, times=1)
    assert faults.should_fire(Fault.EIO_WRITE) and not faults.should_fire(Fault.EIO_WRITE)


@pytest.mark.parametrize("kwargs", [{"times": 0}, {"probability": 1.5}, {"probability": -0.1}, {"delay_s": -1.0}])
def test_arm_validates(kwargs):
    with pytest.raises(ValueError):
        FaultInjector().arm(Fault.EIO_READ, **kwargs)


def test_arm_rejects_non_fault():
    with pytest.raises(TypeError):
        FaultInjector().arm("eio_read")  # type: ignore[arg-type]


def test_thread_safe_exact_count():
    faults = FaultInjector()
    faults.arm(Fault.EIO_READ, times=1000)
    hits = [0] * 8

    def worker(i: int) -> None:
        for _ in range(500):
            if faults.should_fire(Fault.EIO_READ):
                hits[i] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(hits) == 1000
    assert faults.fired[Fault.EIO_READ] == 1000
    assert "eio_read" in repr(faults)

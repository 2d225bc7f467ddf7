"""L3 reads and their checksums (hicache/storage_op.py): when a read lands and when it is verified,
beside its reads, once all landed, or once the caller lets them (`hold_checks`); what it
reports. The store's I/O itself: tests/test_storage.py."""
from __future__ import annotations

import time

import pytest
import torch

from hicache.faults import Fault, FaultInjector
from hicache.storage import FileStore, StorageError
from test_storage import SMALL, _bytes_equal, _flip_byte, _random_pages


def test_verified_read_lands_before_its_checksums_pass():
    """`landed` resolves once the bytes are in the buffer; the read's own future only once the
    checksums passed (held here by SLOW_VERIFY)."""
    faults = FaultInjector()
    src = _random_pages(SMALL, 4, seed=3)
    with FileStore(SMALL, num_slots=8, faults=faults) as s:
        s.write_pages(src, range(4), range(4)).result(timeout=10)
        faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=0.3)
        dst = torch.zeros_like(src)
        fut = s.read_pages(range(4), dst, range(4))
        assert fut.landed.result(timeout=10) is None
        assert not fut.done()  # still hashing
        assert _bytes_equal(src, dst)  # the landed bytes are all there already
        assert fut.result(timeout=10).num_bytes == 4 * SMALL.bytes_per_page
        assert faults.fired[Fault.SLOW_VERIFY] >= 1


def _count_verify_jobs(monkeypatch, store: FileStore) -> list[str]:
    """A list that gets "verify" appended as each checksum job of `store` starts."""
    events: list[str] = []
    verify = store._verify
    monkeypatch.setattr(store, "_verify", lambda *args: (events.append("verify"), verify(*args))[1])
    return events


@pytest.mark.parametrize("after_landing", [False, True])
def test_a_reads_checksums_start_beside_its_reads_or_once_all_landed(monkeypatch, after_landing):
    """By default a piece's checksums start as soon as it is read, beside the read's other pieces
    (the whole read verified soonest). With `checksums_after_landing` none starts before the last
    piece's bytes are in (session 18: hashing beside the reads slowed the landing a taken-on
    prefetch waits for; on the H200 such restores of 350 / 1,000 tokens took 0.5–0.9 ms less), and
    a failed read hashes nothing."""
    import hicache.storage as storage_mod
    monkeypatch.setattr(storage_mod, "MIN_SPLIT_BYTES", 1)  # 8 pages split over the 4 workers
    faults = FaultInjector()
    src = _random_pages(SMALL, 8, seed=5)
    with FileStore(SMALL, num_slots=8, io_workers=4, faults=faults) as s:
        s.write_pages(src, range(8), range(8)).result(timeout=10)
        events = _count_verify_jobs(monkeypatch, s)
        faults.arm(Fault.SLOW_READ, times=1, delay_s=0.2)  # one task lags: the others have landed long before
        dst = torch.empty_like(src)
        fut = s.read_pages(range(8), dst, range(8), checksums_after_landing=after_landing)
        fut.landed.add_done_callback(lambda f: events.append("landed"))
        assert fut.result(timeout=10).num_bytes == 8 * SMALL.bytes_per_page
        assert _bytes_equal(src, dst)
        assert events.count("verify") == 4  # one job per task's piece
        assert (events[0] == "landed") == after_landing
        events.clear()
        faults.arm(Fault.EIO_READ, times=1)
        failed = s.read_pages(range(8), torch.empty_like(src), range(8), checksums_after_landing=after_landing)
        with pytest.raises(StorageError):
            failed.result(timeout=10)
        with pytest.raises(StorageError):
            failed.landed.result(timeout=10)
        if after_landing:
            assert events == []


@pytest.mark.parametrize("released", ["after_landing", "before_landing"])
def test_held_checks_wait_for_the_caller(monkeypatch, released):
    """`hold_checks`: no checksum starts before the caller's `start_checks()`, even once every
    byte landed (a taken-on prefetch: the hashing threads slowed the take-on's enqueue and the
    forward's launch, session 22), and the read resolves only once they passed; a release before
    the landing starts them at the landing. A corrupt page is still caught, and a failed read
    hashes nothing whether released or not."""
    faults = FaultInjector()
    src = _random_pages(SMALL, 4, seed=7)
    with FileStore(SMALL, num_slots=8, io_workers=2, faults=faults) as s:
        s.write_pages(src, range(4), range(4)).result(timeout=10)
        events = _count_verify_jobs(monkeypatch, s)
        dst = torch.empty_like(src)
        if released == "before_landing":
            faults.arm(Fault.SLOW_READ, times=1, delay_s=0.2)
        fut = s.read_pages(range(4), dst, range(4), hold_checks=True)
        if released == "before_landing":
            fut.start_checks()
            assert not fut.landed.done()
        fut.landed.result(timeout=10)
        if released == "after_landing":
            time.sleep(0.1)
            assert events == [] and not fut.done()  # landed, held
            fut.start_checks()
            fut.start_checks()  # idempotent
        result = fut.result(timeout=10)
        assert result.num_bytes == 4 * SMALL.bytes_per_page and result.until_landed_ns > 0
        assert events and _bytes_equal(src, dst)
        events.clear()
        _flip_byte(s.path, 2 * SMALL.bytes_per_page + 3)  # slot 2
        bad = s.read_pages(range(4), torch.empty_like(src), range(4), hold_checks=True)
        bad.landed.result(timeout=10)
        bad.start_checks()
        with pytest.raises(StorageError) as err:
            bad.result(timeout=10)
        assert list(err.value.bad_slots) == [2]
        events.clear()
        faults.arm(Fault.EIO_READ, times=1)
        failed = s.read_pages(range(4), torch.empty_like(src), range(4), hold_checks=True)
        with pytest.raises(StorageError):
            failed.landed.result(timeout=10)
        failed.start_checks()
        with pytest.raises(StorageError):
            failed.result(timeout=10)
        assert events == []


def test_closing_the_store_lets_a_held_reads_checksums_run():
    """Regression (session 22's review): a read whose checksums waited for a `start_checks()` that
    never came was left unresolved by `close()` (and a later release found the verify pool shut)."""
    src = _random_pages(SMALL, 4, seed=8)
    s = FileStore(SMALL, num_slots=8, io_workers=2)
    s.write_pages(src, range(4), range(4)).result(timeout=10)
    dst = torch.empty_like(src)
    fut = s.read_pages(range(4), dst, range(4), hold_checks=True)
    fut.landed.result(timeout=10)
    s.close()
    assert fut.result(timeout=10).num_bytes == 4 * SMALL.bytes_per_page and _bytes_equal(src, dst)
    fut.start_checks()  # (late: a no-op)


def test_a_read_verified_after_landing_reports_its_landing_time():
    """`IoResult.until_landed_ns`: for a read with checksums after its landing, the time until every byte
    landed (what a taken-on prefetch waits for; the cost model learns that); 0 otherwise."""
    faults = FaultInjector()
    src = _random_pages(SMALL, 4, seed=6)
    with FileStore(SMALL, num_slots=8, faults=faults) as s:
        s.write_pages(src, range(4), range(4)).result(timeout=10)
        faults.arm(Fault.SLOW_VERIFY, times=None, delay_s=0.2)
        after = s.read_pages(range(4), torch.empty_like(src), range(4), checksums_after_landing=True).result(timeout=10)
        # the 0.2 s of checksums come after the landing: relative, not a wall-clock bound
        assert 0 < after.until_landed_ns <= after.service_ns - 0.2e9
        beside = s.read_pages(range(4), torch.empty_like(src), range(4)).result(timeout=10)
        assert beside.until_landed_ns == 0 and beside.service_ns >= 0.2e9


def test_landed_then_checksum_failure_and_failed_read_fails_landed():
    faults = FaultInjector()
    src = _random_pages(SMALL, 3, seed=4)
    with FileStore(SMALL, num_slots=8, faults=faults) as s:
        s.write_pages(src, range(3), range(3)).result(timeout=10)
        _flip_byte(s.path, s.offset(1) + 3)
        fut = s.read_pages(range(3), torch.empty_like(src), range(3))
        assert fut.landed.result(timeout=10) is None  # the bytes landed; one of them is wrong
        with pytest.raises(StorageError) as info:
            fut.result(timeout=10)
        assert info.value.kind == "checksum" and info.value.bad_slots == (1,)
        faults.arm(Fault.EIO_READ)  # a read that fails never lands
        fut = s.read_pages([0, 2], torch.empty_like(src), [0, 2])
        with pytest.raises(StorageError) as info:
            fut.landed.result(timeout=10)
        assert info.value.kind == "eio"
        with pytest.raises(StorageError):
            fut.result(timeout=10)
    with FileStore(SMALL, num_slots=8, checksum=False) as s:  # nothing to verify: no separate landing
        s.write_pages(src, range(3), range(3)).result(timeout=10)
        assert not hasattr(s.read_pages(range(3), torch.empty_like(src), range(3)), "landed")


def test_page_checksum_is_xxh3_64():
    """Checksums in existing files and in Redis values are xxh3-64: the GIL-free form agrees."""
    import xxhash

    from hicache.storage import page_checksum
    data = bytes(range(256)) * 1000
    assert page_checksum(memoryview(data)) == xxhash.xxh3_64_intdigest(data)

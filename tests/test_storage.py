"""Tests of the L3 file store (hicache.storage): byte-exact I/O, coalescing, faults, checksums,
close semantics and the bounded worker pool (opening the file safely: test_storage_file.py). CPU
only, fast."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.faults import Fault, FaultInjector
from hicache.geometry import KVGeometry
from hicache.storage import FileStore, IoResult, StorageError, coalesce_extents

SMALL = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)


def _random_pages(geometry: KVGeometry, num_pages: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(geometry.page_major_shape(num_pages), generator=gen).to(geometry.dtype)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def store():
    s = FileStore(SMALL, num_slots=32)
    yield s
    s.close()


# ---- round trips ---------------------------------------------------------------------------------
LAYOUTS = {
    # name: (host pages, slots, expected extents)
    "consecutive": ([0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15], 1),
    "fragmented": ([0, 1, 2, 5, 6, 9], [3, 4, 20, 21, 22, 7], 4),
    "reversed": ([5, 4, 3, 2], [0, 1, 2, 3], 4),
}


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_byte_identical(page_size, dtype, layout):
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=page_size, dtype=dtype)
    host_pages, slots, num_extents = LAYOUTS[layout]
    src = _random_pages(geometry, 12, seed=page_size)
    with FileStore(geometry, num_slots=24) as s:
        wrote = s.write_pages(src, host_pages, slots).result(timeout=10)
        assert isinstance(wrote, IoResult)
        assert wrote.num_bytes == len(slots) * geometry.bytes_per_page
        assert wrote.num_extents == num_extents
        assert wrote.queue_wait_ns >= 0 and wrote.service_ns >= 0
        # read back into different host pages (a fresh workspace), in the same slot order
        dst = torch.zeros_like(src)
        dst_pages = [11 - i for i in range(len(slots))]
        read = s.read_pages(slots, dst, dst_pages).result(timeout=10)
        assert read.num_bytes == wrote.num_bytes
        for hp, dp in zip(host_pages, dst_pages):
            assert _bytes_equal(src[hp], dst[dp])
        # the file holds the page bytes at offset(slot)
        with open(s.path, "rb") as f:
            f.seek(s.offset(slots[0]))
            assert f.read(geometry.bytes_per_page) == src[host_pages[0]].contiguous().view(torch.uint8).numpy().tobytes()


def test_large_transfer_split_across_workers_round_trip():
    geometry = KVGeometry(num_layers=4, num_kv_heads=4, head_dim=64, page_size=16, dtype=torch.bfloat16)
    num_pages = 96  # 64 KiB pages -> 6 MiB, one extent, split over 4 workers
    src = _random_pages(geometry, num_pages, seed=3)
    with FileStore(geometry, num_slots=num_pages, io_workers=4) as s:
        groups = s._plan_tasks([(0, num_pages)], torch.arange(num_pages).numpy(), torch.arange(num_pages).numpy())
        assert 1 < len(groups) <= 4
        covered = sorted(i for g in groups for (start, _, _, n) in g for i in range(start, start + n))
        assert covered == list(range(num_pages))
        assert s.write_pages(src, range(num_pages), range(num_pages)).result(timeout=30).num_extents == 1
        dst = torch.empty_like(src)
        assert s.read_pages(range(num_pages), dst, range(num_pages)).result(timeout=30).num_extents == 1
        assert _bytes_equal(src, dst)


def test_host_buffer_slice_of_larger_pool(store):
    pool = _random_pages(SMALL, 16, seed=5)
    view = pool[4:12]  # contiguous, non-zero storage offset
    store.write_pages(view, [0, 1], [0, 1]).result(timeout=10)
    out = torch.zeros_like(pool)
    store.read_pages([0, 1], out[8:], [2, 3]).result(timeout=10)
    assert _bytes_equal(out[10:12], pool[4:6])


def test_empty_operation(store):
    assert store.write_pages(_random_pages(SMALL, 2), [], []).result(timeout=1) == IoResult(0, 0, 0, 0)


def test_argument_validation(store):
    buf = _random_pages(SMALL, 4)
    with pytest.raises(ValueError):
        store.write_pages(buf, [0, 1], [0])  # length mismatch
    with pytest.raises(ValueError):
        store.write_pages(buf, [0], [32])  # slot out of range
    with pytest.raises(ValueError):
        store.write_pages(buf, [4], [0])  # host page out of range
    with pytest.raises(ValueError):
        store.write_pages(buf, [0, 1], [3, 3])  # duplicate slots
    with pytest.raises(ValueError):
        store.write_pages(buf[:, :1].clone(), [0], [0])  # wrong page size
    with pytest.raises(ValueError):
        store.write_pages(buf.transpose(0, 1), [0], [0])  # not contiguous


def test_io_runs_on_worker_threads(store, monkeypatch):
    seen: list[str] = []
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def spy_pwritev(*args):
        seen.append(threading.current_thread().name)
        return real_pwritev(*args)

    def spy_preadv(*args):
        seen.append(threading.current_thread().name)
        return real_preadv(*args)

    monkeypatch.setattr(os, "pwritev", spy_pwritev)
    monkeypatch.setattr(os, "preadv", spy_preadv)
    buf = _random_pages(SMALL, 4)
    store.write_pages(buf, [0, 1, 3], [0, 1, 9]).result(timeout=10)
    store.read_pages([0, 1, 9], torch.empty_like(buf), [0, 1, 2]).result(timeout=10)
    assert len(seen) == 4
    assert all(name.startswith("hicache-l3-io") for name in seen)
    assert threading.current_thread().name not in seen


# ---- coalescing ----------------------------------------------------------------------------------
def test_coalesce_examples():
    assert coalesce_extents([], []) == []
    assert coalesce_extents([7], [2]) == [(0, 1)]
    assert coalesce_extents([0, 1, 2], [5, 6, 7]) == [(0, 3)]
    assert coalesce_extents([0, 1, 2], [5, 7, 8]) == [(0, 1), (1, 3)]
    assert coalesce_extents([0, 2, 3], [5, 6, 7]) == [(0, 1), (1, 3)]
    assert coalesce_extents([3, 2, 1], [0, 1, 2]) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError):
        coalesce_extents([0], [0, 1])


_runs = st.lists(st.tuples(st.integers(0, 50), st.integers(1, 6)), max_size=12)


def _expand(runs):
    return [start + k for start, length in runs for k in range(length)]


@settings(max_examples=300, deadline=None)
@given(src_runs=_runs, dst_runs=_runs, noise=st.lists(st.integers(0, 60), max_size=40))
def test_coalesce_property(src_runs, dst_runs, noise):
    src, dst = _expand(src_runs), _expand(dst_runs)
    n = min(len(src), len(dst))
    src, dst = src[:n], dst[:n]
    for i, v in enumerate(noise[:n]):  # perturb some entries
        if v % 3 == 0:
            src[i] = v
    extents = coalesce_extents(src, dst)
    covered = [i for a, b in extents for i in range(a, b)]
    assert covered == list(range(n))  # every index once, in order
    for a, b in extents:
        assert a < b
        assert all(src[i + 1] == src[i] + 1 and dst[i + 1] == dst[i] + 1 for i in range(a, b - 1))
    for (_, b), _next in zip(extents, extents[1:]):  # maximal: each boundary is a real break
        assert src[b] != src[b - 1] + 1 or dst[b] != dst[b - 1] + 1


# ---- faults --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fault, kind, op",
    [
        (Fault.EIO_READ, "eio", "read"),
        (Fault.EIO_WRITE, "eio", "write"),
        (Fault.SHORT_READ, "short", "read"),
        (Fault.SHORT_WRITE, "short", "write"),
        (Fault.ENOSPC_WRITE, "enospc", "write"),
    ],
)
def test_fault_raises_kind_then_recovers(fault, kind, op):
    faults = FaultInjector()
    src = _random_pages(SMALL, 6, seed=1)
    # (no backoff after ENOSPC: the recovery is what is checked; the backoff: test_l3_reserve_hunt.py)
    with FileStore(SMALL, num_slots=16, faults=faults, enospc_backoff_s=(0.0, 0.0)) as s:
        s.write_pages(src, range(6), range(6)).result(timeout=10)
        faults.arm(fault, times=1)
        if op == "write":
            fut = s.write_pages(src, range(6), range(6, 12))
        else:
            fut = s.read_pages(range(6), torch.empty_like(src), range(6))
        with pytest.raises(StorageError) as info:
            fut.result(timeout=10)
        assert info.value.kind == kind
        assert faults.fired[fault] == 1
        if op == "write":  # a failed write leaves its slots unreadable, never garbage
            assert s.exists(range(6, 12)) == [False] * 6
            with pytest.raises(StorageError) as info2:
                s.read_pages([6], torch.empty_like(src), [0]).result(timeout=10)
            assert info2.value.kind == "checksum" and info2.value.bad_slots == (6,)
        # a later un-faulted operation works
        s.write_pages(src, range(6), range(6, 12)).result(timeout=10)
        dst = torch.empty_like(src)
        s.read_pages(range(6, 12), dst, range(6)).result(timeout=10)
        assert _bytes_equal(src, dst)


def test_slow_read_delays_but_succeeds():
    faults = FaultInjector()
    src = _random_pages(SMALL, 2)
    with FileStore(SMALL, num_slots=4, faults=faults) as s:
        s.write_pages(src, [0, 1], [0, 1]).result(timeout=10)
        faults.arm(Fault.SLOW_READ, times=1, delay_s=0.05)
        dst = torch.empty_like(src)
        result = s.read_pages([0, 1], dst, [0, 1]).result(timeout=10)
        assert faults.fired[Fault.SLOW_READ] == 1
        assert result.service_ns >= 40_000_000
        assert _bytes_equal(src, dst)


# ---- checksums -----------------------------------------------------------------------------------
def _flip_byte(path: str, offset_bytes: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset_bytes)
        b = f.read(1)
        f.seek(offset_bytes)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("checksum", [True, False])
def test_checksum_catches_bit_flip(checksum):
    src = _random_pages(SMALL, 4, seed=9)
    with FileStore(SMALL, num_slots=8, checksum=checksum) as s:
        s.write_pages(src, range(4), [2, 3, 4, 5]).result(timeout=10)
        _flip_byte(s.path, s.offset(4) + 17)
        dst = torch.empty_like(src)
        fut = s.read_pages([2, 3, 4, 5], dst, range(4))
        if checksum:
            with pytest.raises(StorageError) as info:
                fut.result(timeout=10)
            assert info.value.kind == "checksum" and info.value.bad_slots == (4,)
            assert "4" in str(info.value)
            s.read_pages([2, 3, 5], dst, [0, 1, 3]).result(timeout=10)  # the other slots are fine
        else:
            fut.result(timeout=10)
            diff = (src.view(torch.uint8) != dst.view(torch.uint8)).nonzero()
            assert len(diff) == 1 and diff[0, 0].item() == 2


def test_unwritten_and_invalidated_slots_fail_with_checksum(store):
    src = _random_pages(SMALL, 2)
    with pytest.raises(StorageError) as info:
        store.read_pages([0, 1], torch.empty_like(src), [0, 1]).result(timeout=10)
    assert info.value.kind == "checksum" and info.value.bad_slots == (0, 1)
    store.write_pages(src, [0, 1], [0, 1]).result(timeout=10)
    assert store.exists([0, 1, 2]) == [True, True, False]
    store.invalidate([1])
    assert store.exists([0, 1]) == [True, False]
    with pytest.raises(StorageError) as info:
        store.read_pages([0, 1], torch.empty_like(src), [0, 1]).result(timeout=10)
    assert info.value.bad_slots == (1,)


def test_unwritten_slot_readable_without_checksum():
    with FileStore(SMALL, num_slots=2, checksum=False) as s:
        dst = torch.ones(SMALL.page_major_shape(1))
        s.read_pages([1], dst, [0]).result(timeout=10)
        assert torch.count_nonzero(dst) == 0


def test_invalidate_during_inflight_write_prevents_publication():
    faults = FaultInjector()
    src = _random_pages(SMALL, 2)
    with FileStore(SMALL, num_slots=4, io_workers=1, faults=faults) as s:
        s.write_pages(src, [0], [0]).result(timeout=10)
        faults.arm(Fault.SLOW_READ, times=1, delay_s=0.1)
        blocker = s.read_pages([0], torch.empty_like(src), [1])  # holds the only worker
        write = s.write_pages(src, [1], [3])  # queued behind it
        s.invalidate([3])  # the tree freed the slot before the write landed
        blocker.result(timeout=10)
        write.result(timeout=10)
        assert s.exists([3]) == [False]


def test_drop_page_cache(store, monkeypatch):
    """fsync, then advise the kernel to drop the file's cached pages; False where it refuses (the
    bytes stay readable either way). (Review, session 23: `in (True, False)` could not fail.)"""
    calls = []
    fsync, fadvise = os.fsync, os.posix_fadvise
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), fsync(fd))[1])
    monkeypatch.setattr(os, "posix_fadvise",
                        lambda fd, off, n, advice: (calls.append(advice), fadvise(fd, off, n, advice))[1])
    buf = _random_pages(SMALL, 1)
    store.write_pages(buf, [0], [0]).result(timeout=10)
    assert store.drop_page_cache() is True
    assert calls == ["fsync", os.POSIX_FADV_DONTNEED]

    def refuse(*args):
        raise OSError("fadvise not allowed here")
    monkeypatch.setattr(os, "posix_fadvise", refuse)
    assert store.drop_page_cache() is False
    back = torch.empty_like(buf)
    store.read_pages([0], back, [0]).result(timeout=10)
    assert torch.equal(back, buf)


# ---- close ---------------------------------------------------------------------------------------
def test_operations_after_close_raise():
    s = FileStore(SMALL, num_slots=4)
    buf = _random_pages(SMALL, 1)
    s.write_pages(buf, [0], [0]).result(timeout=10)
    s.close()
    s.close()  # idempotent
    assert s.closed and s.stats()["closed"]
    for call in (lambda: s.write_pages(buf, [0], [1]), lambda: s.read_pages([0], buf, [0]), s.drop_page_cache):
        with pytest.raises(StorageError) as info:
            call()
        assert info.value.kind == "closed"


def test_close_waits_for_inflight_and_can_cancel_queued():
    faults = FaultInjector()
    src = _random_pages(SMALL, 4)
    s = FileStore(SMALL, num_slots=8, io_workers=1, faults=faults)
    s.write_pages(src, range(4), range(4)).result(timeout=10)
    faults.arm(Fault.SLOW_READ, times=1, delay_s=0.2)
    running = s.read_pages([0], torch.empty_like(src), [0])
    deadline = time.monotonic() + 5
    while s.stats()["active_tasks"] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    queued = [s.write_pages(src, [i], [4 + i]) for i in range(3)]
    s.close(cancel_queued=True)
    assert running.result(timeout=0).num_bytes == SMALL.bytes_per_page  # in-flight I/O finished
    for fut in queued:
        with pytest.raises(StorageError) as info:
            fut.result(timeout=0)
        assert info.value.kind == "closed"


# ---- bounded concurrency -------------------------------------------------------------------------
def test_single_worker_serialises_operations():
    """One I/O worker moves one operation's bytes at a time, in submission order. A verified read's
    bytes land in that order (`landed`); its checksums then run on the verify pool, so the read
    itself may resolve after a later write."""
    faults = FaultInjector()
    src = _random_pages(SMALL, 8)
    with FileStore(SMALL, num_slots=16, io_workers=1, faults=faults) as s:
        s.write_pages(src, range(8), range(8)).result(timeout=10)
        faults.arm(Fault.SLOW_READ, times=1, delay_s=0.05)
        faults.arm(Fault.SLOW_VERIFY, times=1, delay_s=0.3)  # the slow read's checksums end after the writes
        order: list[str] = []
        futures = [
            ("slow_read", s.read_pages(range(8), torch.empty_like(src), range(8))),
            ("write_a", s.write_pages(src, [0, 2, 4, 6], [8, 9, 10, 11])),  # several extents, one task
            ("read_b", s.read_pages([1, 3], torch.empty_like(src), [0, 1])),
            ("write_c", s.write_pages(src, [7], [15])),
        ]
        for name, fut in futures:
            # (regression: `name.startswith("read")` took the slow read's whole future, which
            # resolves after its checksums: under load it came after the later writes, a flaky failure)
            io_done = fut.landed if "read" in name else fut
            io_done.add_done_callback(lambda f, name=name: order.append(name))
        for _, fut in futures:
            fut.result(timeout=10)
        assert order == [name for name, _ in futures]
        assert s.stats()["peak_active_tasks"] == 1


def test_pool_bounds_concurrency():
    """io_workers bounds the tasks in flight: with eight slow reads queued at once exactly three
    run together. (Review, session 23: with fast writes alone an unbounded pool passed 1 run in 3.)"""
    faults = FaultInjector()
    src = _random_pages(SMALL, 16)
    with FileStore(SMALL, num_slots=64, io_workers=3, faults=faults) as s:
        futures = [s.write_pages(src, range(0, 16, 2), range(16 * k // 2, 16 * k // 2 + 8)) for k in range(8)]
        for fut in futures:
            assert fut.result(timeout=10).num_extents == 8  # host pages step by 2
        assert 1 <= s.stats()["peak_active_tasks"] <= 3
        faults.arm(Fault.SLOW_READ, times=None, delay_s=0.1)  # every read task holds its worker
        dsts = [torch.empty_like(src) for _ in range(8)]
        reads = [s.read_pages(range(8 * k, 8 * k + 8), dsts[k], range(8)) for k in range(8)]
        for fut in reads:
            fut.result(timeout=10)
        assert s.stats()["peak_active_tasks"] == 3
        assert all(_bytes_equal(dst[:8], src[0:16:2]) for dst in dsts)


# ---- a verified read's bytes land before its checksums pass ----------------------------------------

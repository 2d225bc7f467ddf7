"""Session 61's mutation check of the L3 side (hicache/storage_file.py, storage_op.py, redis_values.py,
transfer_plan.py, operations.py): the rules no earlier test pinned, one fast test each."""
from __future__ import annotations

import concurrent.futures as cf
import errno
import fcntl
import os
import tempfile
import threading
import time

import numpy as np
import pytest

from hicache.storage_file import FD_DIR, open_store_file, release_file
from hicache.storage_op import StorageError, StorageOp

PAGE_BYTES = 4096


# ---- storage_file ---------------------------------------------------------------------------------------
def test_a_temporary_store_file_is_unlinked_as_it_opens():
    """Where /proc/self/fd names the descriptor, the temporary L3 file leaves its directory at once: a
    SIGKILLed engine leaves no GiB behind in /tmp (the kernel frees an unlinked file at any exit)."""
    if not os.path.isdir(FD_DIR):
        pytest.skip("no /proc/self/fd here")
    fd, path, _ = open_store_file(None, 4 * PAGE_BYTES)
    try:
        assert path == f"{FD_DIR}/{fd}"
        assert os.fstat(fd).st_nlink == 0  # no name left in any directory
        assert os.fstat(fd).st_size == 4 * PAGE_BYTES
    finally:
        release_file(fd, path)


def test_a_store_path_that_cannot_be_locked_is_refused_and_an_existing_file_survives(tmp_path, monkeypatch):
    """A file system without locks (NFS without a lock manager): the open is refused, and a file that
    was there before keeps its name and bytes (only a file the store itself created is removed)."""
    path = tmp_path / "l3.kv"
    path.write_bytes(b"precious")

    def flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(ValueError, match="No locks available"):
        open_store_file(path, 4 * PAGE_BYTES)
    assert path.read_bytes() == b"precious"


def test_a_refused_temporary_store_file_gives_its_descriptor_back(monkeypatch):
    """A temporary file refused for want of space is closed (unlinked at open, a leaked descriptor would
    hold its blocks until the process exits)."""
    opened = []
    real = tempfile.mkstemp
    monkeypatch.setattr(tempfile, "mkstemp", lambda **kw: opened.append(real(**kw)) or opened[-1])
    with pytest.raises(ValueError, match="available"):
        open_store_file(None, 1 << 60)
    (fd, name), = opened
    with pytest.raises(OSError):
        os.fstat(fd)
    assert not os.path.exists(name)


def test_a_relative_store_path_is_made_absolute(tmp_path, monkeypatch):
    """The store's path (reported, and the base of a persisted index's name) is absolute, so a later
    change of the working directory cannot point it elsewhere."""
    monkeypatch.chdir(tmp_path)
    fd, path, _ = open_store_file("l3.kv", 2 * PAGE_BYTES)
    release_file(fd, None)
    assert path == str(tmp_path / "l3.kv")


# ---- storage_op -----------------------------------------------------------------------------------------
class _Store:
    """What a StorageOp reads of its FileStore."""
    def __init__(self, checksum: bool = False, verify=None) -> None:
        self.checksum, self.bytes_per_page, self.published = checksum, 100, []
        self._state_lock, self._held = threading.Lock(), set()
        self._verify_pool = cf.ThreadPoolExecutor(max_workers=1) if verify else None
        self._verify = verify

    def _publish(self, slots, gens, hashes) -> None:
        self.published.append(slots.tolist())


def test_an_io_result_counts_from_the_first_task_s_start_to_the_last_one_s_end():
    """IoResult: the bytes of every page, the op's extents, the queue wait until the FIRST task started
    and the service until the LAST one ended, whatever order the tasks report in."""
    store = _Store()
    op = StorageOp(store, False, None, None, np.arange(3), num_tasks=2, num_extents=2, expected=None,
                   gens=np.zeros(3, dtype=np.uint64))
    op.submit_ns = 1_000
    op.started(1_300)
    op.started(1_100)  # (the second task started first)
    op.task_done(None, 5_000)
    assert not op.future.done()
    op.task_done(None, 4_000)  # (and ended first)
    result = op.future.result(timeout=1)
    assert (result.num_bytes, result.num_extents) == (300, 2)
    assert (result.queue_wait_ns, result.service_ns, result.until_landed_ns) == (100, 3_900, 0)
    assert store.published == [[0, 1, 2]]


def test_a_read_s_service_time_runs_until_its_last_checksum():
    """A verified read ends with its last checksum job: that is when its service time ends (the
    cost model learns it), not at its last task's end."""
    gate = threading.Event()
    store = _Store(checksum=True, verify=lambda view, expected, first: (gate.wait(5), [])[1])
    op = StorageOp(store, True, None, None, np.arange(2), num_tasks=1, num_extents=1,
                   expected=np.zeros(2, dtype=np.uint64), gens=None)
    op.started(time.monotonic_ns())
    op.verify(None, np.zeros(2, dtype=np.uint64), 0)
    op.task_landed()
    op.task_done(None, op._first_start_ns + 1)  # (the task ended at once)
    assert op.future.landed.done() and not op.future.done()
    checks_end_ns = time.monotonic_ns()
    gate.set()
    result = op.future.result(timeout=5)
    assert result.service_ns >= checks_end_ns - op._first_start_ns > 1
    assert result.until_landed_ns == 0  # (verified beside its reads: the cost model learns the whole read)
    store._verify_pool.shutdown()


def test_a_storage_error_of_an_unknown_kind_is_refused():
    """StorageError kinds are what metrics' failures count by: a misspelt one is a bug, caught at once."""
    with pytest.raises(ValueError, match="unknown StorageError kind"):
        StorageError("EIO", "x")
    assert StorageError("eio", "x", bad_slots=[3]).bad_slots == (3,)


def test_a_new_store_file_is_created_0600_not_only_chmodded_after(tmp_path, monkeypatch):
    """The file is private from its creation: created 0644 (umask 022) and chmodded later, another user
    could open it in between and keep reading this engine's KV through that descriptor."""
    import stat
    modes = []
    real = os.fchmod
    monkeypatch.setattr(os, "fchmod", lambda fd, mode: (modes.append(stat.S_IMODE(os.fstat(fd).st_mode)),
                                                        real(fd, mode))[1])
    old = os.umask(0o022)
    try:
        fd, path, _ = open_store_file(tmp_path / "l3.kv", 2 * PAGE_BYTES)
    finally:
        os.umask(old)
    release_file(fd, None)
    assert modes == [0o600] and stat.S_IMODE(os.stat(path).st_mode) == 0o600


def _lstat_misses(monkeypatch, path) -> None:
    """The path appears only after the store's first look (os.lstat) at it: a race."""
    real = os.lstat

    def lstat(p, *a, **k):
        if os.fspath(p) == str(path):
            raise FileNotFoundError(errno.ENOENT, "not yet", str(p))
        return real(p, *a, **k)
    monkeypatch.setattr(os, "lstat", lstat)


def test_a_symbolic_link_that_appears_after_the_check_is_not_followed(tmp_path, monkeypatch):
    """O_NOFOLLOW: a link swapped in between the store's check and its open is refused, and the file
    it points at is not truncated."""
    target, link = tmp_path / "target", tmp_path / "l3.kv"
    target.write_bytes(b"keep me")
    link.symlink_to(target)
    _lstat_misses(monkeypatch, link)
    with pytest.raises(ValueError, match="symbolic link"):
        open_store_file(link, 2 * PAGE_BYTES)
    assert target.read_bytes() == b"keep me"


def test_a_foreign_file_that_appears_after_the_check_is_refused_untouched(tmp_path, monkeypatch):
    """What was really opened is checked again (fstat): another user's file swapped in after the first
    look is refused, not truncated."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a file owned by another uid")
    path = tmp_path / "l3.kv"
    path.write_bytes(b"theirs")
    os.chown(path, 54321, -1)
    _lstat_misses(monkeypatch, path)
    with pytest.raises(ValueError, match="owned by uid 54321"):
        open_store_file(path, 2 * PAGE_BYTES)
    assert path.read_bytes() == b"theirs"


def test_a_temporary_file_the_file_system_cannot_reserve_is_reported_sparse(monkeypatch):
    """reserved=False (FileStore.stats()["reserved"]; writes may then hit ENOSPC and back off) for a
    temporary file too, not only for a given path."""
    def posix_fallocate(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    monkeypatch.setattr(os, "posix_fallocate", posix_fallocate)
    fd, path, reserved = open_store_file(None, 2 * PAGE_BYTES)
    release_file(fd, path)
    assert reserved is False


# ---- operations -----------------------------------------------------------------------------------------
def _runner(**mgr):
    from types import SimpleNamespace

    from hicache.operations import OpRunner
    runner = OpRunner(SimpleNamespace(**mgr))
    return runner


def test_an_l3_read_s_deadline_and_bytes():
    """An L3 read's deadline is the configured one or 4x its predicted time, whichever is longer (at most 4x the
    configured one), and what it reads is its pages [l2, l3), not its longest copy."""
    from types import SimpleNamespace

    from hicache.ops import OpKind, new_op
    predict = SimpleNamespace(predict=lambda num_bytes: num_bytes / 1000)
    runner = _runner(config=SimpleNamespace(io_timeout_s=1.0), cost=SimpleNamespace(directions={"s2h": predict}),
                     geometry=SimpleNamespace(bytes_per_page=100))
    assert runner._io_deadline_s(100) == 1.0
    assert runner._io_deadline_s(750) == 3.0
    assert runner._io_deadline_s(2000) == 4.0  # (at most 4x io_timeout_s: tests/test_timers_s74.py)
    op = new_op(1, OpKind.RESTORE_L3, num_pages=5, num_bytes=500)
    assert runner._read_bytes(op) == 500
    op.payload["num_read_pages"] = 2
    assert runner._read_bytes(op) == 200


def test_pending_counts_count_queued_waiting_and_live_ops_by_kind():
    """/hicache/status and hicache_pending_operations: backups queued, waiting for another or live;
    restores (either kind); prefetches; settling tasks."""
    from hicache.ops import OpKind, new_op
    runner = _runner()
    runner._due = [(1,), (2,)]
    runner._deferred = {(3,): [(3, 4), (3, 5)]}
    for i, kind in enumerate([OpKind.BACKUP, OpKind.RESTORE_L2, OpKind.RESTORE_L3, OpKind.PREFETCH_L3]):
        runner.live[i] = new_op(i, kind, num_pages=1, num_bytes=1)
    runner._settling = {object()}
    assert runner.pending_counts() == {"backups": 5, "restores": 2, "prefetches": 1, "settling": 1}


def _io_runner(observed):
    from types import SimpleNamespace
    stats = SimpleNamespace(add=lambda *a, **k: None)
    cost = SimpleNamespace(observe_transfer=lambda d, n, s: observed.append((d, n, round(s, 6))))
    return _runner(metrics=SimpleNamespace(directions={"s2h": stats, "h2s": stats}), cost=cost,
                   geometry=SimpleNamespace(bytes_per_page=100))


@pytest.mark.asyncio
async def test_an_l3_read_teaches_the_cost_model_its_queue_wait_and_its_landing():
    """What the cost model learns of a read: queue wait + service, or, for a read verified after its
    landing, queue wait + the time until it landed (the checksums after it are hidden)."""
    from hicache.ops import OpKind, new_op
    from hicache.storage_op import IoResult
    observed = []
    runner = _io_runner(observed)
    for landed_ns in (200_000_000, 0):
        io = cf.Future()
        io.set_result(IoResult(1000, 1, queue_wait_ns=100_000_000, service_ns=500_000_000, until_landed_ns=landed_ns))
        await runner._wait_io(new_op(1, OpKind.PREFETCH_L3, num_pages=10, num_bytes=1000), io, "s2h")
    assert observed == [("s2h", 1000, 0.3), ("s2h", 1000, 0.6)]


@pytest.mark.asyncio
async def test_an_l3_read_past_its_deadline_is_learned_as_at_least_the_deadline():
    """A read or write past its deadline fails with StorageError("timeout"), and the cost model learns
    the deadline for the bytes it moves (a read: its pages [l2, l3) only), or a storage slower than its
    deadline would never be timed."""
    from hicache.ops import OpKind, new_op
    observed = []
    runner = _io_runner(observed)
    ios = []
    for kind, direction in ((OpKind.PREFETCH_L3, "s2h"), (OpKind.BACKUP, "h2s")):
        op = new_op(1, kind, num_pages=5, num_bytes=500)
        op.payload["num_read_pages"] = 2
        ios.append(cf.Future())
        with pytest.raises(StorageError) as err:
            await runner._wait_io(op, ios[-1], direction, deadline_s=0.01)
        assert err.value.kind == "timeout"
    assert observed == [("s2h", 200, 0.01), ("h2s", 500, 0.01)]
    for io in ios:
        io.set_result(None)


def test_a_read_whose_checksum_job_failed_never_reports_landed():
    """`landed` resolves with the read's error once it failed, even if its last bytes land after the
    failure (here a checksum job that raised): a prefetch must not be taken on to L1 from a failed read."""
    def verify(view, expected, first):
        if first == 0:
            raise MemoryError("checksum job failed")
        return []
    store = _Store(checksum=True, verify=verify)
    op = StorageOp(store, True, None, None, np.arange(4), num_tasks=2, num_extents=1,
                   expected=np.zeros(4, dtype=np.uint64), gens=None)
    op.verify(None, np.zeros(2, dtype=np.uint64), 0)  # task 1's pages: their checksum job raises
    op.task_landed()
    op.task_done(None, time.monotonic_ns())
    store._verify_pool.submit(lambda: None).result(timeout=5)  # (the failed job has reported)
    op.verify(None, np.zeros(2, dtype=np.uint64), 2)  # task 2's pages land after the failure
    op.task_landed()
    op.task_done(None, time.monotonic_ns())
    for future in (op.future.landed, op.future):
        with pytest.raises(MemoryError):
            future.result(timeout=5)
    store._verify_pool.shutdown()


def test_held_checks_let_go_before_the_landing_still_wait_for_every_checksum():
    """hold_checks, released (start_checks) before every byte landed: the checksums start at the landing,
    all counted, so the read resolves only once each passed; a page whose checksum fails last still
    fails the read (none may resolve it early, unverified)."""
    gate = threading.Event()

    def verify(view, expected, first):
        if first == 2:
            gate.wait(5)
            return [2]  # slot 2 is corrupt
        return []
    store = _Store(checksum=True, verify=verify)
    op = StorageOp(store, True, None, None, np.arange(4), num_tasks=2, num_extents=1,
                   expected=np.zeros(4, dtype=np.uint64), gens=None, hold_checks=True)
    op.verify(None, np.zeros(2, dtype=np.uint64), 0)  # task 1's pages landed
    op.task_landed()
    op.future.start_checks()  # let go before task 2 landed
    store._verify_pool.submit(lambda: None).result(timeout=5)
    op.task_done(None, time.monotonic_ns())
    op.verify(None, np.zeros(2, dtype=np.uint64), 2)  # task 2's pages
    op.task_landed()
    op.task_done(None, time.monotonic_ns())
    assert op.future.landed.done() and not op.future.done()  # slot 2's checksum still runs
    gate.set()
    with pytest.raises(StorageError) as err:
        op.future.result(timeout=5)
    assert err.value.kind == "checksum" and err.value.bad_slots == (2,)
    assert not store._held
    store._verify_pool.shutdown()


def test_a_held_read_that_failed_before_its_checks_were_let_go_leaves_the_store():
    """A hold_checks read that failed (never landed) is not kept in the store's held reads for good."""
    store = _Store(checksum=True, verify=lambda view, expected, first: [])
    op = StorageOp(store, True, None, None, np.arange(2), num_tasks=1, num_extents=1,
                   expected=np.zeros(2, dtype=np.uint64), gens=None, hold_checks=True)
    assert store._held == {op}
    op.task_done(StorageError("eio", "injected", bad_slots=[0, 1]), time.monotonic_ns())
    with pytest.raises(StorageError):
        op.future.landed.result(timeout=5)
    assert not store._held
    store._verify_pool.shutdown()


def test_an_op_s_bytes_are_its_pages_bytes():
    """An op's num_bytes (the "op" log event's bytes, the timeline's, the timeout's sample) is in bytes."""
    from types import SimpleNamespace

    from hicache.ops import OpKind
    runner = _runner(geometry=SimpleNamespace(bytes_per_page=4096))
    op = runner._new(OpKind.BACKUP, 3, "r1")
    assert (op.num_pages, op.num_bytes, op.request_id) == (3, 3 * 4096, "r1")
    assert op.payload == {"locks": [], "claims": {}, "cancel": False}


# ---- redis_values ---------------------------------------------------------------------------------------
def test_a_redis_value_is_refused_unless_it_is_this_key_s_whole_page():
    """check_value: a value of another size, magic, payload length or key (moved under another key) is
    "checksum", a missing one "missing"; the payload's checksum is checked only with checksums on."""
    from hicache.redis_values import HEADER, MAGIC, check_value, key_digest, pack_value
    page = memoryview(bytes(range(256)) * 2)
    key, n = b"hicache:v2:abc", len(page)
    value = pack_value(page, key)
    assert len(value) == HEADER.size + n
    assert check_value(value, key, n, verify=True) is None and check_value(value, key, n, verify=False) is None
    assert check_value(None, key, n, verify=True) == "missing"
    _, _, _, digest = HEADER.unpack_from(value)
    wrong = {"longer": value + b"\0", "magic": b"HKV1" + value[4:], "key": value,
             "length": HEADER.pack(MAGIC, n - 1, key_digest(key), digest) + bytes(page)}
    for why, bad in wrong.items():
        for verify in (True, False):
            assert check_value(bad, b"hicache:v2:abd" if why == "key" else key, n, verify) == "checksum", why
    flipped = value[:-1] + bytes([value[-1] ^ 1])
    assert check_value(flipped, key, n, verify=True) == "checksum"
    assert check_value(flipped, key, n, verify=False) is None  # (checksums off: not hashed)


# ---- transfer_plan --------------------------------------------------------------------------------------
def test_transfer_plans_chunks_and_runs():
    """ramp_chunks / gathered_chunks (the D2H pipeline's chunks; docs example: 3 direct pages, then 6, 96
    and 395), consecutive_runs (both lists, capped at max_runs), host_runs (first page of each run)."""
    from hicache.transfer_plan import consecutive_runs, gathered_chunks, host_runs, ramp_chunks
    assert ramp_chunks(500, 3, 16) == [3, 48, 449] and ramp_chunks(2, 4, 16) == [2]
    for bad in ((0, 4, 16), (2, 0, 16), (2, 4, 0)):
        with pytest.raises(ValueError):
            ramp_chunks(*bad)
    assert gathered_chunks(497, 3, 3) == [6, 96, 395]
    assert gathered_chunks(108, 3, 3) == [6, 96, 6]  # a last chunk as long as the first keeps its own launch
    assert gathered_chunks(105, 3, 3) == [6, 99]  # a shorter one rides with the chunk before it
    assert gathered_chunks(4, 0, 8) == [4]
    assert consecutive_runs([1, 2, 3, 7, 8], [5, 6, 9, 10, 11]) == [(0, 2), (2, 3), (3, 5)]
    assert consecutive_runs([1, 2, 3]) == [(0, 3)] and consecutive_runs([3, 3]) == [(0, 1), (1, 2)]
    assert consecutive_runs([0, 2, 4], max_runs=3) == [(0, 1), (1, 2), (2, 3)]
    assert consecutive_runs([0, 2, 4], max_runs=2) is None
    assert host_runs([4, 5, 9]) == [(0, 2, 4), (2, 3, 9)] and host_runs([0, 2, 4], max_runs=2) is None


@pytest.mark.asyncio
async def test_a_backup_whose_task_is_cancelled_before_it_ran_frees_its_key():
    """A backup's driver task cancelled before it ran (it never reached its finally): its key leaves the
    backups in flight, or no later backup of those tokens would ever start (each would see it in flight),
    and its pages are freed."""
    import asyncio

    from hicache.ops import OpState
    from hicache_helpers import assert_whole, make_manager, toks, write_prefix
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64)
    tokens = toks((1, 17))  # 16 tokens, 4 pages
    write_prefix(mgr, tokens)
    op = mgr.runner.start_backup(tokens) or next(iter(mgr.runner.live.values()))  # (or the one it started)
    assert op.kind.value == "backup" and mgr.runner._backing_up
    task = mgr.runner._tasks[op.op_id]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert op.state is OpState.CANCELLED
    await mgr.drain()
    assert not mgr.runner._backing_up
    assert mgr.runner.start_backup(tokens) is not None  # backed up again
    await mgr.drain()
    assert_whole(mgr)
    await mgr.close()


def test_failed_write_back_backups_are_remembered_for_the_latest_1024_leaves_only():
    """Under write_back a failed backup's L1 node is remembered (its leaf is then evicted unsaved), the
    latest 1,024 only: a long run of failing L3 writes must not grow the table for good."""
    from types import SimpleNamespace

    from hicache.ops import OpEvent, OpKind, apply
    metrics = SimpleNamespace(count_failure=lambda kind: None)
    runner = _runner(write_back=True, tree=SimpleNamespace(tick=7), metrics=metrics,
                     geometry=SimpleNamespace(bytes_per_page=1))
    for node_id in range(1, 1101):
        op = runner._new(OpKind.BACKUP, 1, None)
        apply(op, OpEvent.START)
        op.payload["backup_node"] = node_id
        runner._fail(op, "eio", "eio")
    assert list(runner._backup_failed) == list(range(77, 1101)) and set(runner._backup_failed.values()) == {7}

"""One L3 read or write in flight (hicache/storage.py's `FileStore` runs them): its I/O tasks report
here, a read's checksum jobs run on the store's verify pool (beside its reads, once every byte landed,
or once the caller lets them: `ReadFuture.start_checks`), and the last of them resolves the future
to an `IoResult` or a `StorageError`."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from .storage import FileStore


class StorageError(Exception):
    """An L3 operation failed. `kind` is one of KINDS; `bad_slots` names slots whose checksum failed,
    that hold no valid page (kind "missing": a shared store's page vanished) or that a read could
    not get back (kinds "eio", "short"), so the caller can drop their residency."""

    KINDS = frozenset({"eio", "short", "enospc", "checksum", "timeout", "closed", "missing"})

    def __init__(self, kind: str, message: str, *, bad_slots: Sequence[int] = (), errno_: int | None = None):
        if kind not in self.KINDS:
            raise ValueError(f"unknown StorageError kind {kind!r}")
        super().__init__(f"[{kind}] {message}")
        self.kind = kind
        self.bad_slots: tuple[int, ...] = tuple(int(s) for s in bad_slots)
        self.errno = errno_


def refuse_own_thread(*pools: cf.ThreadPoolExecutor | None) -> None:
    """FileStore.close() on one of its own pools' threads (in a done-callback of an operation's future: it runs where
    the operation ended) would join that very thread as the pools shut down: refused before anything closes
    (regression: "cannot join current thread" left the store marked closed with its file, lock and threads)."""
    if any(threading.current_thread() in pool._threads for pool in pools if pool is not None):
        raise RuntimeError("FileStore.close() on one of its own I/O threads (in a callback of an operation's "
                           "future) would wait for itself: close it from another thread")


class IoResult(NamedTuple):
    num_bytes: int
    num_extents: int
    queue_wait_ns: int  # submit -> start of the first worker
    service_ns: int  # start of the first worker -> end of the last (and of the last checksum)
    until_landed_ns: int = 0  # a read with checksums after its landing: start of the first worker -> landed


class ReadFuture(cf.Future):
    """A verified read's future (resolves once every checksum passed), with `landed`: a future
    that resolves (to None) as soon as every byte is in the host buffer, while the checksums may
    still be running, or with the read's error when a read failed. A restore may start copying the
    landed bytes onward, as long as it accepts what it computed from them only once the read's
    own future succeeded (hicache/restores.py, `take_to_l1`)."""

    def __init__(self) -> None:
        super().__init__()
        self.landed: cf.Future = cf.Future()
        # as the read's own, it cannot be cancelled: a waiter's give-up (a wait_for on its asyncio wrapper) cancelled
        # it, and the I/O thread's set_result raised (regression: the read failed, or its checksums never started)
        self.landed.set_running_or_notify_cancel()
        self._start_held = None  # read_pages(hold_checks=True): what start_checks() calls

    def start_checks(self) -> None:
        """read_pages(hold_checks=True): let the checksums start (once every byte landed).
        Idempotent; a no-op for any other read."""
        if self._start_held is not None:
            self._start_held()


class StorageOp:
    """One read or write: its tasks report here; the last one resolves the future."""

    def __init__(self, store: FileStore, is_read: bool, buffer_ref: torch.Tensor, view: memoryview,
                 slots: np.ndarray, num_tasks: int, num_extents: int, expected: np.ndarray | None,
                 gens: np.ndarray | None, checksums_after_landing: bool = False,
                 hold_checks: bool = False, key_digests: np.ndarray | None = None) -> None:
        self.store, self.is_read, self.slots, self.num_extents = store, is_read, slots, num_extents
        self.buffer_ref, self.view = buffer_ref, view  # keep the caller's memory alive while workers use it
        self.expected = expected  # read: checksums to verify against, by op index
        self.gens = gens  # write: slot generations at submit; published only if unchanged
        self.hashes = np.zeros(len(slots), dtype=np.uint64) if (not is_read and store.checksum) else None
        self.key_digests = key_digests  # write: its pages' keys' digests, bound into what it publishes
        self.future: cf.Future = ReadFuture() if expected is not None else cf.Future()
        self.future.set_running_or_notify_cancel()  # I/O cannot be abandoned midway: no cancel
        self._landed_left = num_tasks  # verified reads: tasks whose bytes have not all landed yet
        self.checksums_after_landing = checksums_after_landing or hold_checks
        self._checks_held = hold_checks  # until the caller's start_checks()
        self._jobs_counted = False  # the held jobs are in _verify_left (every byte landed)
        if hold_checks and isinstance(self.future, ReadFuture):
            self.future._start_held = self.start_held_checks
            with store._state_lock:
                store._held.add(self)
        self._verify_jobs: list[tuple[memoryview, np.ndarray, int]] = []  # held until landed (bytes, checksums, first slot)
        self._verify_left = 0  # checksum jobs started and not yet done
        self._landed_at_ns = 0  # when the last byte landed (verified reads)
        self.submit_ns = time.monotonic_ns()
        self._lock = threading.Lock()
        self._tasks_left = num_tasks
        self._first_start_ns: int | None = None
        self._last_end_ns = 0
        self._error: BaseException | None = None
        self._bad_slots: list[int] = []

    def started(self, now_ns: int) -> None:
        with self._lock:
            if self._first_start_ns is None or now_ns < self._first_start_ns:
                self._first_start_ns = now_ns

    def verify(self, view: memoryview, expected: np.ndarray, first_slot: int) -> None:
        """A landed piece's checksum job: started now on the verify pool, or, with
        `checksums_after_landing`, once every byte of the read landed (`task_landed`)."""
        with self._lock:
            if self.checksums_after_landing:
                self._verify_jobs.append((view, expected, first_slot))
                return
            self._verify_left += 1
        self._start_verify(view, expected, first_slot)

    def _start_verify(self, view: memoryview, expected: np.ndarray, first_slot: int) -> None:
        job = self.store._verify_pool.submit(self.store._verify, view, expected, first_slot)
        job.add_done_callback(self._verified)

    def task_landed(self) -> None:
        """A task's reads all landed (its checksums may still be running, or not started yet)."""
        with self._lock:
            self._landed_left -= 1
            if self._landed_left > 0 or self._error is not None:
                return
            self._verify_left += len(self._verify_jobs)  # counted now: the read cannot finish before them
            self._jobs_counted = True
            held, self._verify_jobs = ([], self._verify_jobs) if self._checks_held else (self._verify_jobs, [])
            self._landed_at_ns = time.monotonic_ns()
        self.future.landed.set_result(None)
        for job in held:
            self._start_verify(*job)

    def start_held_checks(self) -> None:
        """hold_checks: the caller lets the checksums start (now if every byte landed, else
        at the landing)."""
        with self._lock:
            self._checks_held = False
            held, self._verify_jobs = (self._verify_jobs, []) if self._jobs_counted else ([], self._verify_jobs)
        with self.store._state_lock:
            self.store._held.discard(self)
        for job in held:
            self._start_verify(*job)

    def _verified(self, job: cf.Future) -> None:
        error = job.exception()
        with self._lock:
            self._verify_left -= 1
            if error is not None and self._error is None:
                self._error = error
            elif error is None:
                self._bad_slots.extend(job.result())
            self._last_end_ns = max(self._last_end_ns, time.monotonic_ns())
            if self._tasks_left > 0 or self._verify_left > 0:
                return
        self._finish()

    def task_done(self, error: BaseException | None, end_ns: int) -> None:
        with self._lock:
            self._tasks_left -= 1
            if error is not None and self._error is None:
                self._error = error
            elif isinstance(error, StorageError):  # a second task's failure: its slots are bad too
                self._bad_slots.extend(error.bad_slots)
            self._last_end_ns = max(self._last_end_ns, end_ns)
            if self._tasks_left > 0 or self._verify_left > 0:
                return
        self._finish()

    def _finish(self) -> None:
        self.view = None  # type: ignore[assignment]
        self.buffer_ref = None  # type: ignore[assignment]
        if self._checks_held:  # a read that failed before its checks were let go: none ever will be
            with self.store._state_lock:  # (regression: the store kept every such read for good)
                self.store._held.discard(self)
        if self._error is not None:
            if isinstance(self._error, StorageError) and self._bad_slots:
                # every slot the read found bad names, not only the first failed task's (regression:
                # another task's failure and the checksums that failed were dropped, and their
                # pages kept their residency: the next read failed on them again)
                self._error.bad_slots = tuple(sorted({*self._error.bad_slots, *self._bad_slots}))
            if isinstance(self.future, ReadFuture) and not self.future.landed.done():  # a read failed
                self.future.landed.set_exception(self._error)
            self.future.set_exception(self._error)
            return
        if self._bad_slots:
            bad = sorted(self._bad_slots)
            self.future.set_exception(StorageError(
                "checksum", f"checksum mismatch in L3 slots {bad}", bad_slots=bad))
            return
        if not self.is_read:
            hashes = self.hashes  # (bound to the keys: storage.bound_checksums)
            if hashes is not None and self.key_digests is not None:
                hashes = hashes ^ self.key_digests
            self.store._publish(self.slots, self.gens, hashes)
        first = self._first_start_ns if self._first_start_ns is not None else self.submit_ns
        self.future.set_result(IoResult(
            num_bytes=len(self.slots) * self.store.bytes_per_page,
            num_extents=self.num_extents,
            queue_wait_ns=max(0, first - self.submit_ns),
            service_ns=max(0, self._last_end_ns - first),
            until_landed_ns=(max(1, self._landed_at_ns - first)
                             if self.checksums_after_landing and self._landed_at_ns else 0),
        ))

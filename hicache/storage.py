"""L3: one local file of fixed page slots (DESIGN.md sections 3, 5 and 12).

Slot s lives at byte offset s * bytes_per_page and holds the same bytes as one page-major L2 page.
This class only moves bytes: which slot holds what is decided by the cache tree and its allocator.

I/O goes straight between the file and the caller's CPU tensor through memoryviews (os.preadv / os.pwritev, no
copies), one syscall per extent (a run where both host pages and slots are consecutive; a large one split between
threads, a verified read's in ~8 MiB pieces), on a bounded thread pool, never on the caller's thread. Each operation
returns a concurrent.futures.Future resolving to an IoResult or raising StorageError; a failed operation never returns
garbage: short transfers, I/O errors and (when enabled) checksum mismatches all fail it.
A slot's checksum is bound to the prefix its page was computed for (`bound_checksums`): a read of
a slot under another prefix's key (a kept index edited since, a slot mixed up) fails like a corrupt
page, never restores another prefix's KV.
One operation in flight, its checksum jobs and its result: hicache/storage_op.py.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from .faults import Fault, FaultInjector
from .geometry import KVGeometry
from .page_keys import PageKeyer
from .storage_file import open_store_file, release_file
from .storage_op import IoResult, ReadFuture, StorageError, StorageOp, refuse_own_thread  # noqa: F401 (the API)

# An extent is split into pieces of at least this many bytes so that one large transfer can use
# several worker threads (cold buffered reads scale with threads, DESIGN.md section 10).
MIN_SPLIT_BYTES = 1 << 20
VERIFY_CHUNK_BYTES = 8 << 20  # a read hands its checksum work on in pieces of about this size
_READ_ERROR_FAULTS = ((Fault.EIO_READ, errno.EIO),)
_WRITE_ERROR_FAULTS = ((Fault.EIO_WRITE, errno.EIO), (Fault.ENOSPC_WRITE, errno.ENOSPC))


def coalesce_extents(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges over which both src and dst pages increase by exactly 1."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"page lists differ in length: {len(src_pages)} vs {len(dst_pages)}")
    n = len(src_pages)
    if n == 0:
        return []
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    bounds = [0, *breaks.tolist(), n]
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _error_from_oserror(exc: OSError, what: str) -> StorageError:
    # (EFBIG: past a file size limit, `ulimit -f`: no room, as a full disk; regression: eio on every such write)
    kind = "enospc" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "eio"
    return StorageError(kind, f"{what}: {exc.strerror or exc}", errno_=exc.errno)


def page_checksum(page: memoryview) -> int:
    """xxh3-64 of one page, through the hasher object, which hashes without holding the GIL (the
    one-shot `xxhash.xxh3_64_intdigest`, same value, holds it for the whole page), so the verify
    threads hash side by side and beside the engine's loop. On the H200 at 350 / 1,000 tokens the
    two forms restored equally fast (docs/benchmarks.md, session 15)."""
    return xxhash.xxh3_64(page).intdigest()


def key_digests(keys: Sequence[bytes] | None, num_pages: int) -> np.ndarray | None:
    """The 64-bit digests (xxh3-64, as redis_values.key_digest) of the pages' prefix keys, that a slot's
    checksum is XORed with (`bound_checksums`); None without keys (the bytes' checksum alone)."""
    if keys is None:
        return None
    if len(keys) != num_pages:
        raise ValueError(f"{len(keys)} keys for {num_pages} pages")
    return np.fromiter((xxhash.xxh3_64_intdigest(k) for k in keys), dtype=np.uint64, count=num_pages)


def bound_checksums(checksums: np.ndarray, digests: np.ndarray | None) -> np.ndarray:
    """What a slot keeps, and a read expects of its bytes' checksum XOR its key's digest: xxh3-64 of its
    page XOR the digest of the prefix key it was written under (unbound without keys). Its own inverse:
    a read expects `bound_checksums(kept, its keys' digests)` of the bytes, which only the page written
    under the same key passes."""
    return checksums if digests is None else checksums ^ digests


def _size_of(path: str | os.PathLike) -> int | None:
    """The size of the file at `path` in bytes; None where there is none (or it cannot be seen)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _done_future(result: IoResult | None = None, error: BaseException | None = None) -> cf.Future:
    future: cf.Future = cf.Future()
    future.set_exception(error) if error is not None else future.set_result(result)
    return future


class FileStore:
    """A file of `num_slots` page slots with asynchronous, coalesced, checksummed page I/O."""

    # read_pages(checksums_after_landing=True): a read's bytes land before it is verified, so a
    # caller may start on them then (hicache/restores.py asks for it for a prefetch taken on soon)
    can_check_after_landing = True

    def __init__(self, geometry: KVGeometry, num_slots: int, path: str | None = None, io_workers: int = 4,
                 checksum: bool = True, faults: FaultInjector | None = None,
                 enospc_backoff_s: tuple[float, float] = (1.0, 60.0), persistent: bool = False,
                 key_salt: bytes | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if io_workers < 1:
            raise ValueError(f"io_workers must be >= 1, got {io_workers}")
        self.geometry, self.num_slots, self.io_workers = geometry, int(num_slots), int(io_workers)
        self.bytes_per_page = geometry.bytes_per_page
        self.size_bytes = self.num_slots * self.bytes_per_page
        self.checksum, self.faults, self.is_temp = bool(checksum), faults, path is None
        # persistent: the file's content outlives the process, its index saved at a clean close and
        # adopted at the next open (hicache/l3_index.py); it is kept, not truncated, as it opens
        if persistent and (path is None or not self.checksum):
            raise ValueError("a persistent L3 file needs a path and checksums")
        self.persistent = bool(persistent)
        # the file's size before this open resized it (None: there was none): an index saved with another
        # size describes a file deleted or cut short since, and is not adopted (l3_index._problem)
        self.found_bytes = _size_of(path) if self.persistent else None
        fd, self.path, self.reserved = open_store_file(path, self.size_bytes, keep=self.persistent)
        self._fd = fd
        self._finalizer = weakref.finalize(self, release_file, fd, self.path if self.is_temp else None)
        # key_salt (page_keys.kv_salt): each slot's checksum is bound to its page's prefix key, which
        # CacheManager.page_keys passes to write_pages / read_pages (`keys=`) while `binds_keys`
        self.keyer = PageKeyer(key_salt, geometry.page_size) if key_salt is not None and self.checksum else None
        self.binds_keys = self.keyer is not None
        self._checksums = np.zeros(self.num_slots, dtype=np.uint64)
        self._valid = np.zeros(self.num_slots, dtype=bool)  # written and not invalidated since
        self._gens = np.zeros(self.num_slots, dtype=np.uint64)
        self._meta_lock = threading.Lock()  # guards the three per-slot arrays
        self._state_lock = threading.Lock()  # guards closing, submission order and task counters
        self._closed = False
        self._active_tasks = self._peak_active_tasks = 0
        # after an ENOSPC write (a sparse file, storage_file._reserve) writes are refused until
        # _writes_paused_until (clock() seconds), lo doubling to hi per ENOSPC, reset by a success
        self.enospc_backoff_s, self.clock = enospc_backoff_s, time.monotonic
        self._writes_paused_until, self._enospc_streak, self.enospc_backoffs = 0.0, 0, 0
        self._pool = cf.ThreadPoolExecutor(max_workers=self.io_workers, thread_name_prefix="hicache-l3-io")
        self._held: set[StorageOp] = set()  # reads with hold_checks whose checksums have not been let go
        # read verification: an I/O thread hands each landed piece's checksums to this pool and reads
        # on, so hashing overlaps the next preadv instead of following it; or they wait until the
        # whole read landed (read_pages(checksums_after_landing=True))
        self._verify_pool = (cf.ThreadPoolExecutor(max_workers=self.io_workers, thread_name_prefix="hicache-l3-verify")
                             if self.checksum else None)

    # ---- public API ------------------------------------------------------------------------------
    def offset(self, slot: int) -> int:
        return slot * self.bytes_per_page

    def page_keys(self, tokens: Sequence[int], start_tokens: int, end_tokens: int) -> list[bytes]:
        """The prefix keys (page_keys.PageKeyer) of the pages covering tokens[start_tokens:end_tokens]."""
        return self.keyer.keys(tokens, start_tokens, end_tokens)

    def write_pages(self, host_buffer: torch.Tensor, host_pages: Sequence[int], slots: Sequence[int],
                    keys: Sequence[bytes] | None = None) -> cf.Future:
        """Write host_buffer[host_pages[i]] into slot slots[i], its checksum bound to keys[i] (the
        page's prefix key, `bound_checksums`; none: to the bytes alone); resolves to IoResult. Refused
        (StorageError "enospc") while backing off after an ENOSPC (`write_retry_in_s`), once its
        arguments passed the checks every write gets (regression: a bad slot got "enospc", not
        ValueError, until the pause ended)."""
        checked = self._checked(False, host_buffer, host_pages, slots, keys)
        wait_s = self.write_retry_in_s()
        if wait_s > 0:
            return _done_future(error=StorageError(
                "enospc", f"L3 writes to {self.path!r} paused after ENOSPC (retry in {wait_s:.2f} s)"))
        return self._submit(checked)

    def write_retry_in_s(self) -> float:
        """Seconds until writes are tried again after an ENOSPC (0: they go ahead); the backups skip
        their L3 write meanwhile (hicache/backups.py), as RedisStore backs off a dead server."""
        return max(0.0, self._writes_paused_until - self.clock())

    def read_pages(self, slots: Sequence[int], host_buffer: torch.Tensor, host_pages: Sequence[int],
                   checksums_after_landing: bool = False, hold_checks: bool = False,
                   keys: Sequence[bytes] | None = None) -> cf.Future:
        """Read slot slots[i] into host_buffer[host_pages[i]]; resolves to IoResult (a ReadFuture
        when checksums are on: its `landed` resolves first). Each page is verified against the
        checksum its write kept, bound to keys[i] (as the write's: a page written under another
        prefix fails it, "checksum"). A piece's checksums start as soon as
        it is read, beside the read's other pieces, so the whole read is verified soonest; with
        `checksums_after_landing` they all start once every byte landed, so the bytes land soonest
        (for a caller that takes them on then: a prefetch taken on to L1, hicache/restores.py);
        with `hold_checks` once every byte landed and the caller called
        `future.start_checks()` (the hashing threads would slow the caller's own work meanwhile)."""
        return self._submit(self._checked(True, host_buffer, host_pages, slots, keys), checksums_after_landing,
                            hold_checks)

    def invalidate(self, slots: Sequence[int]) -> None:
        """Forget what the slots hold (the tree freed them); an in-flight write will not publish."""
        idx = self._slot_array(slots)
        with self._meta_lock:
            self._gens[idx] += np.uint64(1)
            self._valid[idx] = False

    def exists(self, slots: Sequence[int]) -> list[bool]:
        """Whether each slot holds a completed, not invalidated write."""
        idx = self._slot_array(slots)
        with self._meta_lock:
            return self._valid[idx].tolist()

    def checksums_of(self, slots: Sequence[int]) -> np.ndarray:
        """The checksums the slots' writes published, bound to their keys (uint64; 0 where none was taken)."""
        idx = self._slot_array(slots)
        with self._meta_lock:
            return self._checksums[idx].copy()

    def adopt(self, slots: Sequence[int], checksums: np.ndarray) -> None:
        """Slots that a persisted index says hold pages written by an earlier process (hicache/l3_index.py):
        readable from now on, each read verified against its checksum (as `checksums_of` gave it: bound to
        the page's prefix key, so a slot adopted under another prefix fails its first read)."""
        idx = self._slot_array(slots)
        with self._meta_lock:
            self._checksums[idx] = np.asarray(checksums, dtype=np.uint64)
            self._valid[idx] = True

    def sync(self) -> None:
        """fsync the file: the bytes an index about to be saved describes are on the disk first."""
        self._check_open()
        os.fsync(self._fd)

    def drop_page_cache(self) -> bool:
        """fsync and evict the file from the OS page cache (cold-read benchmarks); False if not allowed."""
        self._check_open()
        if not hasattr(os, "posix_fadvise"):
            return False
        try:
            os.fsync(self._fd)
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            return False
        return True

    def close(self, cancel_queued: bool = False) -> None:
        """Wait for in-flight I/O (queued operations too, unless cancel_queued: those fail with
        StorageError('closed')), then close the file; a temp file is removed, a path is kept."""
        with self._state_lock:
            if self._closed:
                return
            refuse_own_thread(self._pool, self._verify_pool)  # (before anything closes; a closed store: a no-op)
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=cancel_queued)
        with self._state_lock:
            held = list(self._held)
        for op in held:  # reads whose checksums wait for a caller: they must finish too
            op.start_held_checks()
        if self._verify_pool is not None:
            self._verify_pool.shutdown(wait=True)
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict:
        with self._state_lock:
            peak, active = self._peak_active_tasks, self._active_tasks
        with self._meta_lock:
            valid_slots = int(self._valid.sum())
        return {"path": self.path, "num_slots": self.num_slots, "bytes_per_page": self.bytes_per_page,
                "is_temp": self.is_temp, "size_bytes": self.size_bytes, "io_workers": self.io_workers,
                "checksum": self.checksum, "closed": self._closed, "valid_slots": valid_slots,
                "active_tasks": active, "peak_active_tasks": peak, "reserved": self.reserved,
                "write_retry_in_s": self.write_retry_in_s(), "enospc_backoffs": self.enospc_backoffs,
                "persistent": self.persistent}

    def __enter__(self) -> FileStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- submission ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("closed", f"L3 store {self.path!r} is closed")

    def _slot_array(self, slots: Sequence[int]) -> np.ndarray:
        idx = np.asarray(slots, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_slots):
            bad = idx[(idx < 0) | (idx >= self.num_slots)]
            raise ValueError(f"slot out of range [0, {self.num_slots}): {bad[:8].tolist()}")
        return idx

    def _byte_view(self, host_buffer: torch.Tensor) -> tuple[memoryview, int]:
        if not isinstance(host_buffer, torch.Tensor):
            raise TypeError(f"host_buffer must be a torch.Tensor, got {type(host_buffer).__name__}")
        if host_buffer.device.type != "cpu" or not host_buffer.is_contiguous() or host_buffer.dim() == 0:
            raise ValueError("host_buffer must be a contiguous CPU tensor with pages on dim 0")
        num_pages = host_buffer.shape[0]
        flat = host_buffer.detach()
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        flat = flat.reshape(-1)
        if flat.numel() != num_pages * self.bytes_per_page:
            raise ValueError(f"host_buffer holds {flat.numel()} bytes for {num_pages} pages; "
                             f"store pages are {self.bytes_per_page} bytes")
        return memoryview(flat.numpy()).cast("B"), num_pages

    def _checked(self, is_read: bool, host_buffer: torch.Tensor, host_pages: Sequence[int], slots: Sequence[int],
                 keys: Sequence[bytes] | None = None) -> tuple:
        """An operation's arguments, checked: (is_read, host_buffer, its byte view or None when no
        page moves, host pages, slots as int64 arrays, the keys' digests or None: `key_digests`, none
        without checksums). Raises StorageError "closed" or ValueError."""
        self._check_open()
        slot_arr = self._slot_array(slots)
        host_arr = np.asarray(host_pages, dtype=np.int64).reshape(-1)
        if len(host_arr) != len(slot_arr):
            raise ValueError(f"{len(host_arr)} host pages but {len(slot_arr)} slots")
        digests = key_digests(keys, len(slot_arr)) if self.checksum else None
        if len(slot_arr) == 0:
            return is_read, host_buffer, None, host_arr, slot_arr, digests
        view, num_host_pages = self._byte_view(host_buffer)
        if host_arr.min() < 0 or host_arr.max() >= num_host_pages:
            raise ValueError(f"host page out of range [0, {num_host_pages})")
        dest = host_arr if is_read else slot_arr
        if len(np.unique(dest)) != len(dest):
            raise ValueError(f"duplicate destination {'host pages' if is_read else 'slots'} in one operation")
        return is_read, host_buffer, view, host_arr, slot_arr, digests

    def _submit(self, checked: tuple, checksums_after_landing: bool = False, hold_checks: bool = False) -> cf.Future:
        is_read, host_buffer, view, host_arr, slot_arr, digests = checked
        if len(slot_arr) == 0:
            return _done_future(IoResult(0, 0, 0, 0))
        extents = coalesce_extents(host_arr, slot_arr)
        groups = self._plan_tasks(extents, host_arr, slot_arr)
        expected = gens = None
        with self._meta_lock:
            if is_read and self.checksum:
                invalid = slot_arr[~self._valid[slot_arr]]
                if invalid.size:
                    return _done_future(error=StorageError(
                        "checksum", f"L3 slots {invalid.tolist()} hold no valid page", bad_slots=invalid.tolist()))
                expected = bound_checksums(self._checksums[slot_arr], digests)  # (a copy)
            if not is_read:
                self._gens[slot_arr] += np.uint64(1)
                self._valid[slot_arr] = False
                gens = self._gens[slot_arr].copy()
        op = StorageOp(self, is_read, host_buffer, view, slot_arr, len(groups), len(extents), expected, gens,
                       checksums_after_landing, hold_checks, None if is_read else digests)
        with self._state_lock:
            if self._closed:
                raise StorageError("closed", f"L3 store {self.path!r} is closed")
            for k, pieces in enumerate(groups):
                try:
                    inner = self._pool.submit(self._run_task, op, pieces)
                except RuntimeError as exc:  # (a thread that cannot start): the groups queued still run, so the
                    # op fails through its future once they ended, never here (its caller would free the pages
                    # they are reading into: `OpRunner._not_started`)
                    for _ in groups[k:]:
                        op.task_done(exc, time.monotonic_ns())
                    break
                inner.add_done_callback(lambda f, op=op: f.cancelled() and op.task_done(
                    StorageError("closed", "L3 store closed before the operation ran"), time.monotonic_ns()))
        return op.future

    def _plan_tasks(self, extents: list[tuple[int, int]], host_arr: np.ndarray,
                    slot_arr: np.ndarray) -> list[list[tuple[int, int, int, int]]]:
        """Pieces (op_index, host_page, slot, num_pages) grouped into at most io_workers tasks;
        large extents are split at page boundaries so one big transfer uses several threads."""
        total_pages = len(slot_arr)
        min_split_pages = -(-MIN_SPLIT_BYTES // self.bytes_per_page)
        max_piece_pages = max(-(-total_pages // self.io_workers), min_split_pages, 1)
        pieces = []
        for start, end in extents:
            for s in range(start, end, max_piece_pages):
                n = min(end, s + max_piece_pages) - s
                pieces.append((s, int(host_arr[s]), int(slot_arr[s]), n))
        num_tasks = min(self.io_workers, len(pieces))
        target_pages = -(-total_pages // num_tasks)
        groups: list[list[tuple[int, int, int, int]]] = []
        current: list[tuple[int, int, int, int]] = []
        current_pages = 0
        for piece in pieces:
            current.append(piece)
            current_pages += piece[3]
            if current_pages >= target_pages and len(groups) < num_tasks - 1:
                groups.append(current)
                current, current_pages = [], 0
        if current:
            groups.append(current)
        return groups

    def _publish(self, slots: np.ndarray, gens: np.ndarray, hashes: np.ndarray | None) -> None:
        with self._meta_lock:
            fresh = self._gens[slots] == gens
            idx = slots[fresh]
            if hashes is not None:
                self._checksums[idx] = hashes[fresh]
            self._valid[idx] = True
        with self._state_lock:  # a write went through: the disk has room again
            self._enospc_streak, self._writes_paused_until = 0, 0.0

    def _enospc_seen(self) -> None:
        """A write failed with ENOSPC: refuse writes for lo * 2**(n-1) s (at most hi), n counting
        ENOSPCs since the last success (its exponent capped: a disk full for days must not overflow
        the float); one while already backing off (another task's) does not count."""
        with self._state_lock:
            now_s = self.clock()
            if now_s < self._writes_paused_until:
                return
            self._enospc_streak += 1
            self.enospc_backoffs += 1
            lo, hi = self.enospc_backoff_s
            self._writes_paused_until = now_s + min(hi, lo * 2.0 ** min(self._enospc_streak - 1, 32))

    # ---- worker side -----------------------------------------------------------------------------
    def _run_task(self, op: StorageOp, pieces: list[tuple[int, int, int, int]]) -> None:
        op.started(time.monotonic_ns())
        with self._state_lock:
            self._active_tasks += 1
            self._peak_active_tasks = max(self._peak_active_tasks, self._active_tasks)
        error: BaseException | None = None
        unread = [0, pieces[0][2]]  # (piece index, slot): the first page this task has not read whole
        try:
            self._do_pieces(op, pieces, unread)
        except OSError as exc:
            error = _error_from_oserror(exc, f"L3 {'read' if op.is_read else 'write'} of {self.path!r}")
            if not op.is_read and error.kind == "enospc":
                self._enospc_seen()
        except BaseException as exc:  # StorageError, or a bug: report it through the future
            error = exc
        finally:
            with self._state_lock:
                self._active_tasks -= 1
        if op.is_read and isinstance(error, StorageError) and error.kind in ("eio", "short"):
            # the file cannot give these pages back (truncated, a bad sector): name them, so that
            # their residency is dropped and the next backup writes them again; from the first one
            # not read whole on (regression: a file truncated inside a prefix named every slot of
            # the task, and the pages before its end, which had landed, left L3 with the rest)
            index, first_slot = unread
            _, _, slot, n = pieces[index]
            error.bad_slots = (*range(first_slot, slot + n),
                               *(s for _, _, later, m in pieces[index + 1:] for s in range(later, later + m)))
        op.task_done(error, time.monotonic_ns())

    def _do_pieces(self, op: StorageOp, pieces: list[tuple[int, int, int, int]], unread: list[int]) -> None:
        """unread: set to (piece index, slot) of the first page not yet moved whole."""
        bpp, faults, is_read = self.bytes_per_page, self.faults, op.is_read
        if is_read and faults is not None and faults.should_fire(Fault.SLOW_READ):
            time.sleep(faults.delay_s(Fault.SLOW_READ))
        step_pages = max(1, VERIFY_CHUNK_BYTES // bpp) if op.expected is not None else 1 << 62
        for index, (op_index, host_page, slot, n) in enumerate(pieces):
            unread[:] = [index, slot]
            view = op.view[host_page * bpp:(host_page + n) * bpp]
            if op.hashes is not None:  # write: hash the bytes being written, off the event loop
                for k in range(n):
                    op.hashes[op_index + k] = page_checksum(view[k * bpp:(k + 1) * bpp])
            short = False
            if faults is not None:
                errors = _READ_ERROR_FAULTS if is_read else _WRITE_ERROR_FAULTS
                for fault, code in errors:
                    if faults.should_fire(fault):
                        raise OSError(code, f"injected {fault.value}")
                short = faults.should_fire(Fault.SHORT_READ if is_read else Fault.SHORT_WRITE)
            for k0 in range(0, n, step_pages):  # one piece, or (verified reads) sub-pieces
                k1 = min(n, k0 + step_pages)
                self._transfer_all(is_read, view[k0 * bpp:k1 * bpp], self.offset(slot + k0), short,
                                   slot + k0, k1 - k0, unread)
                if op.expected is not None:  # read: its checksums, beside the next read or once all landed
                    op.verify(view[k0 * bpp:k1 * bpp], op.expected[op_index + k0:op_index + k1], slot + k0)
        if op.expected is not None:
            op.task_landed()

    def _verify(self, view: memoryview, expected: np.ndarray, first_slot: int) -> list[int]:
        bpp = self.bytes_per_page
        if self.faults is not None and self.faults.should_fire(Fault.SLOW_VERIFY):
            time.sleep(self.faults.delay_s(Fault.SLOW_VERIFY))
        return [first_slot + k for k in range(len(expected))
                if page_checksum(view[k * bpp:(k + 1) * bpp]) != int(expected[k])]

    def _transfer_all(self, is_read: bool, view: memoryview, offset_bytes: int, short: bool, slot: int,
                      num_pages: int, unread: list[int]) -> None:
        """Loop one extent's syscall over partial transfers; 0 before completion fails it.
        `short` (fault injection) makes the first call move half the extent and the next report 0.
        unread[1]: the first slot not moved whole yet."""
        syscall = os.preadv if is_read else os.pwritev
        total_bytes, done_bytes = len(view), 0
        while done_bytes < total_bytes:
            if short and done_bytes:
                moved = 0
            else:
                end = done_bytes + max(1, (total_bytes - done_bytes) // 2) if short else total_bytes
                moved = syscall(self._fd, [view[done_bytes:end]], offset_bytes + done_bytes)
            if moved == 0:
                raise StorageError("short", f"short {'read' if is_read else 'write'} of L3 slots [{slot}, "
                                            f"{slot + num_pages}) in {self.path!r}: {done_bytes} of {total_bytes} "
                                            f"bytes")
            done_bytes += moved
            unread[1] = slot + done_bytes // self.bytes_per_page

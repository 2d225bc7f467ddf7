"""Opening the L3 file (hicache/storage.py): a temporary file, unlinked as it opens (the kernel frees it at any exit),
or a user-given path opened safely (no symbolic links, no other owner's file, no non-regular file; created 0600,
truncated: old content is meaningless without this process's slot metadata; locked, so a second
store on the same path, in this process or another, is refused instead of truncating and
overwriting the first's pages), each checked for room on its filesystem before it is sized, and
its size reserved (`_reserve`: posix_fallocate; sparse, with a warning, where the file system cannot)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile

import structlog

log = structlog.get_logger("hicache.storage")
FD_DIR = "/proc/self/fd"  # (Linux) an open file by its descriptor: a temporary L3 file's path once it is unlinked


def open_store_file(path: str | os.PathLike | None, size_bytes: int, keep: bool = False) -> tuple[int, str, bool]:
    """(fd, absolute path, reserved) of a store file of `size_bytes`; path None: a fresh temporary
    file. reserved: its blocks are allocated (False: a sparse file, see `_reserve`). keep: a path's
    content is kept (only resized), for a persisted index to adopt (hicache/l3_index.py).
    What the OS refuses (a size over the file system's largest file, no locks, no free-space
    figure) is a ValueError naming the file and the flags (regression: a bare OSError, "[Errno 27]
    File too large", naming neither)."""
    if path is not None:
        path = os.path.abspath(os.fspath(path))
        try:
            fd, reserved = _open_path(path, size_bytes, keep)
            return fd, path, reserved
        except OSError as exc:
            raise ValueError(f"L3 storage file {path!r}: {exc.strerror or exc}; choose another "
                             f"--hicache-storage-path or lower --hicache-storage-size-gb / "
                             f"--hicache-storage-ratio") from exc
    name = tempfile.gettempdir()
    try:
        fd, name = tempfile.mkstemp(prefix="hicache-l3-", suffix=".kv")
        temp_path = _unlinked(fd, name)
        try:
            _check_free_space(fd, name, size_bytes, 0)
            os.ftruncate(fd, size_bytes)
            reserved = _reserve(fd, name, size_bytes)
        except BaseException:
            release_file(fd, temp_path)
            raise
    except OSError as exc:
        raise ValueError(f"L3 storage file {name!r} (a temporary file: no --hicache-storage-path "
                         f"given): {exc.strerror or exc}; give --hicache-storage-path or lower "
                         f"--hicache-storage-size-gb / --hicache-storage-ratio") from exc
    return fd, temp_path, reserved


def _unlinked(fd: int, name: str) -> str:
    """A temporary file removed from its directory at once where its descriptor names it (Linux's /proc/self/fd/N,
    its path from then on): the kernel frees its blocks at any exit (regression: a replay stopped by SIGTERM, any
    process by SIGKILL, left GiB of it in /tmp). Elsewhere, or where the name cannot be removed now, the name:
    removed at close (`release_file`)."""
    by_fd = f"{FD_DIR}/{fd}"
    if not os.path.exists(by_fd):
        return name
    try:
        os.unlink(name)
    except OSError:
        return name
    return by_fd


def release_file(fd: int, temp_path: str | None) -> None:
    """Close the file and remove `temp_path` (None: keep it). A file that cannot be removed (its
    file system went read-only) is a warning naming it, not an error (regression: the OSError
    escaped the engine's shutdown and skipped the rest of it)."""
    with contextlib.suppress(OSError):
        os.close(fd)
    if temp_path is not None and not temp_path.startswith(FD_DIR + "/"):  # (a descriptor's: nothing to remove)
        try:
            os.unlink(temp_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("l3_file_left_behind", path=temp_path, error=exc.strerror or str(exc))


def _reserve(fd: int, path: str, size_bytes: int, kept_bytes: int = 0) -> bool:
    """Allocate the file's blocks (it is already `size_bytes` long), so that a disk other processes
    fill later cannot fail its writes with ENOSPC (regression: the file stayed sparse, its free-space
    check reserved nothing). Extent allocation, no zeroing: ~5 ms for 1-2 GiB on ext4. A file system
    that cannot (EOPNOTSUPP / ENOSYS / EINVAL: some network or FUSE ones) keeps a sparse file, one
    warning naming it (FileStore then backs off after an ENOSPC write); False. Any other failure
    (ENOSPC, EDQUOT) cuts the file back to `kept_bytes` (0: empties it), giving a partial reservation back,
    and raises (regression: a kept file's content went with it)."""
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            log.warning("l3_file_sparse", path=path, size_bytes=size_bytes, error=exc.strerror or str(exc),
                        hint="the file system cannot reserve the L3 file's space: writes may hit ENOSPC "
                             "if the disk fills")
            return False
        with contextlib.suppress(OSError):
            os.ftruncate(fd, kept_bytes)
        raise
    return True


def _check_free_space(fd: int, path: str, needed_bytes: int, occupied_bytes: int) -> None:
    st = os.fstatvfs(fd)
    available_bytes = st.f_bavail * st.f_frsize + occupied_bytes  # the file's own blocks are reusable
    if needed_bytes > available_bytes:
        raise ValueError(
            f"L3 storage file {path!r} needs {needed_bytes} bytes ({needed_bytes / 2**30:.2f} GiB) but only "
            f"{available_bytes} bytes ({available_bytes / 2**30:.2f} GiB) are available on its filesystem; "
            f"lower --hicache-storage-size-gb / --hicache-storage-ratio or choose another path")


def _check_existing(path: str, st: os.stat_result) -> None:
    why = ("it is a symbolic link" if stat.S_ISLNK(st.st_mode)
           else "it exists and is not a regular file" if not stat.S_ISREG(st.st_mode)
           else f"it is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()})"
           if st.st_uid != os.geteuid() else None)
    if why is not None:
        raise ValueError(f"refusing --hicache-storage-path {path!r}: {why}")


def _open_path(path: str, size_bytes: int, keep: bool = False) -> tuple[int, bool]:
    """Open (create) a user-given store path safely, truncated (keep: not) and sized; returns (fd, reserved)."""
    with contextlib.suppress(FileNotFoundError):
        _check_existing(path, os.lstat(path))
    flags, created = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, False
    try:
        try:
            fd, created = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
        except FileExistsError:
            fd = os.open(path, flags)
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise ValueError(f"refusing --hicache-storage-path {path!r}: {why}") from exc
    try:
        st = os.fstat(fd)  # re-check what was really opened (the path may have changed meanwhile)
        _check_existing(path, st)
        _lock(fd, path)
    except OSError:  # (the OS failed us, e.g. a file system without locks: one we created goes)
        release_file(fd, path if created else None)
        raise
    except BaseException:
        release_file(fd, None)  # (a file another store holds, or one it opened since we created it)
        raise
    try:
        _check_free_space(fd, path, size_bytes, st.st_blocks * 512)
        if not keep:
            os.ftruncate(fd, 0)  # old content is meaningless: the metadata lives in this process
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size_bytes)
        reserved = _reserve(fd, path, size_bytes, min(st.st_size, size_bytes) if keep else 0)
    except BaseException:
        release_file(fd, path if created else None)
        raise
    return fd, reserved


def _lock(fd: int, path: str) -> None:
    """An exclusive advisory lock on the open file, held until its fd closes."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"refusing --hicache-storage-path {path!r}: another store has it open (this process or "
                         f"another); give each engine its own --hicache-storage-path") from None

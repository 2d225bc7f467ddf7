"""The file L3's edge rules that no test ran (session 72 coverage hunt): its arguments refused with a clear
error (keys of another length, no I/O worker, a buffer that is no tensor), a write racing a close fails
"closed" (not a thread pool's RuntimeError), a temporary file that cannot be unlinked at once is removed at
close instead (and one already gone is no warning), a folder that cannot be synced keeps the persisted index
working (best effort), and a cold-read benchmark's page-cache drop says False where the OS has no fadvise."""
from __future__ import annotations

import errno
import os
import stat

import pytest
import torch
from structlog.testing import capture_logs

from hicache import storage_file
from hicache.l3_index import index_path
from hicache.radix import Tier
from hicache.storage import FileStore, StorageError
from hicache_helpers import assert_whole
from test_l3_persist import A, B, _manager, _restore_from_l3, _saved
from test_storage import SMALL, _bytes_equal, _random_pages


def test_keys_of_another_length_than_the_pages_are_refused():
    """A write / read given a prefix key per page must give one per page: else ValueError naming both."""
    with FileStore(SMALL, num_slots=8, key_salt=b"salt") as s:
        buf = _random_pages(SMALL, 2)
        with pytest.raises(ValueError, match="1 keys for 2 pages"):
            s.write_pages(buf, [0, 1], [0, 1], keys=[b"k0"])
        with pytest.raises(ValueError, match="3 keys for 2 pages"):
            s.read_pages([0, 1], buf, [0, 1], keys=[b"k0", b"k1", b"k2"])
        assert s.exists([0, 1]) == [False, False]


def test_a_store_without_an_io_worker_is_refused():
    with pytest.raises(ValueError, match="io_workers must be >= 1, got 0"):
        FileStore(SMALL, num_slots=4, io_workers=0)


@pytest.mark.parametrize("buffer", [[0.0] * 8, None])
def test_a_host_buffer_that_is_no_tensor_is_a_type_error(buffer):
    with FileStore(SMALL, num_slots=4) as s:
        with pytest.raises(TypeError, match=f"host_buffer must be a torch.Tensor, got {type(buffer).__name__}"):
            s.write_pages(buffer, [0], [0])


def test_a_write_racing_a_close_fails_closed_and_leaves_nothing_running():
    """The store closes between a write's argument checks and its submission (another thread's close): the
    write raises StorageError "closed", rather than reaching the shut thread pool (a RuntimeError failing the
    op's future), and the store is closed with no task running."""
    s = FileStore(SMALL, num_slots=4)
    src = _random_pages(SMALL, 1)
    s.write_retry_in_s = lambda: s.close() or 0.0  # (called between the checks and the submission)
    with pytest.raises(StorageError) as info:
        s.write_pages(src, [0], [0])
    assert info.value.kind == "closed" and s.closed
    assert s.stats()["active_tasks"] == 0 and s.exists([0]) == [False]


def test_a_temp_file_that_cannot_be_unlinked_at_once_is_removed_at_close(monkeypatch):
    """Where the new temporary file's name cannot be removed as it opens, the store keeps it by its name (the
    store works) and removes it at close."""
    real_unlink = os.unlink
    refused: list[str] = []

    def unlink_refusing_once(path, *args, **kwargs):
        if not refused and os.path.basename(path).startswith("hicache-l3-"):
            refused.append(path)
            raise PermissionError(errno.EACCES, "refused")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(storage_file.os, "unlink", unlink_refusing_once)
    s = FileStore(SMALL, num_slots=4)
    assert refused == [s.path] and os.path.exists(s.path) and s.is_temp
    src, dst = _random_pages(SMALL, 2, seed=3), torch.zeros(SMALL.page_major_shape(2), dtype=SMALL.dtype)
    s.write_pages(src, [0, 1], [2, 3]).result(timeout=20)
    s.read_pages([2, 3], dst, [0, 1]).result(timeout=20)
    assert _bytes_equal(src, dst)
    s.close()
    assert not os.path.exists(refused[0])


def test_a_temp_file_already_gone_at_close_is_no_warning(monkeypatch, tmp_path):
    """Where no descriptor folder names the file (not Linux), the temporary file is removed by name at close;
    one that is gone already (another process cleaned the temp folder) is no warning and no error."""
    monkeypatch.setattr(storage_file, "FD_DIR", str(tmp_path / "no-fd-dir"))
    s = FileStore(SMALL, num_slots=4)
    assert os.path.exists(s.path) and not s.path.startswith("/proc/")
    os.unlink(s.path)
    with capture_logs() as logs:
        s.close()
    assert s.closed and [e for e in logs if e["event"] == "l3_file_left_behind"] == []


def test_the_page_cache_drop_says_false_where_the_os_cannot_advise(monkeypatch):
    with FileStore(SMALL, num_slots=4) as s:
        assert s.drop_page_cache() is True
        monkeypatch.delattr(os, "posix_fadvise")
        assert s.drop_page_cache() is False


@pytest.mark.asyncio
@pytest.mark.parametrize("fails", ["open", "fsync"])
async def test_a_folder_that_cannot_be_synced_keeps_the_persisted_index(tmp_path, monkeypatch, fails):
    """Syncing the index's folder is best effort (some network file systems refuse it): the index is saved
    without a warning, and the next manager adopts it (the read deletes it, its folder unsynced too), its
    prefixes restored byte for byte."""
    real_open, real_fsync = os.open, os.fsync

    def open_no_dirs(path, flags, *args, **kwargs):
        if fails == "open" and flags & os.O_DIRECTORY:
            raise PermissionError(errno.EACCES, "no folder opens here")
        return real_open(path, flags, *args, **kwargs)

    def fsync_no_dirs(fd):
        if fails == "fsync" and stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "no folder syncs here")
        return real_fsync(fd)

    monkeypatch.setattr(os, "open", open_no_dirs)
    monkeypatch.setattr(os, "fsync", fsync_no_dirs)
    with capture_logs() as logs:
        want = await _saved(tmp_path, A, B)
        mgr = _manager(tmp_path)
    assert [e for e in logs if e["log_level"] == "warning"] == []
    assert not os.path.exists(index_path(str(tmp_path / "l3.kv")))
    assert mgr.tree.num_resident_pages == [0, 0, (len(A) + len(B) - 16) // 4]
    assert torch.equal(await _restore_from_l3(mgr, A), want[0])
    assert mgr.tree.match(A, touch=False).lengths[Tier.L1] == len(A)
    assert_whole(mgr)
    await mgr.close()

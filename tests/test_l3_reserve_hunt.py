"""The L3 file's space is reserved at start-up (os.posix_fallocate, hicache/storage_file.py), so a
disk that other processes fill later cannot fail its writes; where the file system cannot reserve
(EOPNOTSUPP / ENOSYS / EINVAL: some network or FUSE file systems) the file stays sparse with one
warning naming it, and a write that then hits ENOSPC makes the store back off: L3 writes are
refused for a while (1 s doubling to 60 s, reset by a successful write), the backups skip their L3
write (a `write_l3` policy skip) instead of each failing, and reads go on. Regression: the file was
sized with ftruncate (sparse: the free-space check reserved nothing) and every backup after a full
disk tried its L3 write and failed with ENOSPC."""
from __future__ import annotations

import errno
import os
import tempfile

import pytest
import torch
from structlog.testing import capture_logs

from hicache.geometry import KVGeometry
from hicache.radix import Tier
from hicache.storage import FileStore, StorageError
from hicache_helpers import assert_whole
from test_faults import OTHER, PROMPT, REUSABLE, finish, make_engine, only_in_l3, reference, run_one

SMALL = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
NUM_SLOTS = 256  # 256 KiB: several file system blocks


def _fail_fallocate(code: int):
    def posix_fallocate(fd, offset, length):
        raise OSError(code, os.strerror(code))
    return posix_fallocate


class _Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


# -- start-up: the configured size is the store's --------------------------------------------------
@pytest.mark.parametrize("use_path", [True, False], ids=["path", "temp"])
def test_the_store_file_holds_its_whole_size_on_disk(tmp_path, use_path):
    """Regression: the file was sparse (ftruncate), so its blocks were not the store's: a disk
    filled later by other processes failed its writes."""
    path = tmp_path / "l3.kv" if use_path else None
    with FileStore(SMALL, NUM_SLOTS, path=path) as store:
        st = os.stat(store.path)
        assert st.st_size == store.size_bytes
        assert st.st_blocks * 512 >= store.size_bytes, (st.st_blocks * 512, store.size_bytes)
        assert store.stats()["reserved"] is True


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL], ids=["eopnotsupp", "enosys", "einval"])
def test_a_file_system_that_cannot_reserve_gets_a_sparse_file_and_one_warning(tmp_path, monkeypatch, code):
    monkeypatch.setattr(os, "posix_fallocate", _fail_fallocate(code))
    path = str(tmp_path / "l3.kv")
    with capture_logs() as logs:
        store = FileStore(SMALL, NUM_SLOTS, path=path)
    warnings = [e for e in logs if e.get("log_level") == "warning"]
    assert len(warnings) == 1 and path in repr(warnings[0]), logs
    assert os.stat(path).st_size == store.size_bytes
    assert store.stats()["reserved"] is False
    host = torch.arange(2 * store.bytes_per_page, dtype=torch.uint8).reshape(2, -1)
    store.write_pages(host, [0, 1], [3, 4]).result()  # a working store
    back = torch.zeros_like(host)
    store.read_pages([3, 4], back, [0, 1]).result()
    assert torch.equal(back, host)
    store.close()


@pytest.mark.parametrize("use_path", [True, False], ids=["path", "temp"])
def test_a_disk_that_cannot_hold_the_reservation_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch, use_path):
    """fallocate fails with ENOSPC (free space went meanwhile, quotas, reserved blocks): the
    start-up error names the file and the flags, and a file the store created is removed."""
    monkeypatch.setattr(os, "posix_fallocate", _fail_fallocate(errno.ENOSPC))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = tmp_path / "l3.kv" if use_path else None
    with pytest.raises(ValueError) as info:
        FileStore(SMALL, NUM_SLOTS, path=path)
    message = str(info.value)
    assert "No space left on device" in message and "--hicache-storage-size-gb" in message, message
    assert (str(path) if use_path else str(tmp_path)) in message, message
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_that_cannot_hold_the_reservation_gives_its_blocks_back(tmp_path, monkeypatch):
    """A file of ours that existed is kept (as the free-space check keeps it), but emptied: a
    partial reservation must not hold the disk after a refused start."""
    path = tmp_path / "l3.kv"
    path.write_bytes(b"x" * (64 << 10))
    os.chmod(path, 0o600)
    monkeypatch.setattr(os, "posix_fallocate", _fail_fallocate(errno.ENOSPC))
    with pytest.raises(ValueError, match="No space left on device"):
        FileStore(SMALL, NUM_SLOTS, path=path)
    assert path.exists() and os.stat(path).st_blocks == 0


# -- ENOSPC on write (a sparse file): the store backs off --------------------------------------------
def _enospc_pwritev(calls: list):
    def pwritev(fd, buffers, offset):
        calls.append(offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return pwritev


def test_after_enospc_writes_are_refused_with_a_doubling_backoff_reset_by_a_success(tmp_path, monkeypatch):
    store = FileStore(SMALL, NUM_SLOTS, path=tmp_path / "l3.kv")
    clock = store.clock = _Clock()
    host = torch.ones(1, store.bytes_per_page, dtype=torch.uint8)
    real, calls = os.pwritev, []
    monkeypatch.setattr(os, "pwritev", _enospc_pwritev(calls))
    with pytest.raises(StorageError, match="enospc"):
        store.write_pages(host, [0], [0]).result()
    assert len(calls) == 1
    assert store.stats()["write_retry_in_s"] == 1.0 and store.write_retry_in_s() == 1.0
    # refused without touching the disk while the backoff lasts
    with pytest.raises(StorageError, match="enospc"):
        store.write_pages(host, [0], [1]).result()
    assert len(calls) == 1
    clock.now_s += 1.0
    with pytest.raises(StorageError, match="enospc"):  # tried again: still full, twice as long
        store.write_pages(host, [0], [1]).result()
    assert len(calls) == 2 and store.write_retry_in_s() == 2.0
    for _ in range(8):  # ... up to 60 s
        clock.now_s += 60.0
        with pytest.raises(StorageError):
            store.write_pages(host, [0], [1]).result()
    assert store.write_retry_in_s() == 60.0
    # reads go on meanwhile (a slot written before is not one of them: its write failed)
    with pytest.raises(StorageError, match="checksum"):
        store.read_pages([0], host.clone(), [0]).result()
    monkeypatch.setattr(os, "pwritev", real)
    clock.now_s += 60.0
    store.write_pages(host, [0], [2]).result()  # room again: written, and the backoff is reset
    assert store.write_retry_in_s() == 0.0 and store.stats()["write_retry_in_s"] == 0.0
    back = torch.zeros_like(host)
    store.read_pages([2], back, [0]).result()
    assert torch.equal(back, host)
    monkeypatch.setattr(os, "pwritev", _enospc_pwritev(calls))
    with pytest.raises(StorageError):
        store.write_pages(host, [0], [3]).result()
    assert store.write_retry_in_s() == 1.0  # from the start again
    assert store.stats()["enospc_backoffs"] == 11
    store.close()


@pytest.mark.asyncio
async def test_backups_after_a_full_disk_skip_l3_until_the_backoff_passes_and_reads_go_on(monkeypatch):
    """Through the engine: one backup's L3 write fails with ENOSPC; the next backups do not try
    L3 (no pwritev, no failure: `policy_skips.write_l3`) while the backoff lasts; a prompt L3 held
    before is still read from it; once the backoff passed and the disk has room, L3 is written and
    read back. Outputs equal recompute; every pool whole."""
    eng = make_engine()
    await eng.start()
    want, want_other = await reference(PROMPT), await reference(OTHER)
    tokens = tuple(PROMPT[:REUSABLE])
    assert (await run_one(eng)).output_ids == want  # PROMPT written to L3 (room)
    await eng.cache.drain()
    only_in_l3(eng, tokens)
    store = eng.cache.store
    clock = store.clock = _Clock()
    real, calls = os.pwritev, []
    monkeypatch.setattr(os, "pwritev", _enospc_pwritev(calls))
    # the disk is full: OTHER's backup fails once with ENOSPC
    assert (await run_one(eng, OTHER)).output_ids == want_other
    await eng.cache.drain()
    assert eng.metrics()["failures"] == {"enospc": 1}, eng.metrics()["failures"]
    assert store.write_retry_in_s() > 0
    attempted, skips = len(calls), eng.metrics()["policy_skips"]["write_l3"]
    # PROMPT is read from L3 meanwhile, and its backups (L1 lost it) skip L3; so does OTHER's
    out = await run_one(eng)
    assert out.output_ids == want and out.cached_tokens.get("l3", 0) == REUSABLE, out.cached_tokens
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    eng.cache.tree.evict(Tier.L2, eng.cache.l2.num_pages)
    assert (await run_one(eng, OTHER)).output_ids == want_other
    await eng.cache.drain()
    assert len(calls) == attempted  # no L3 write tried
    assert eng.metrics()["failures"] == {"enospc": 1}
    assert eng.metrics()["policy_skips"]["write_l3"] > skips
    status = eng.cache.status()
    assert status["storage"]["write_retry_in_s"] > 0 and status["storage"]["enospc_backoffs"] == 1
    eng.cache.check_integrity()
    assert_whole(eng.cache)
    # room again, and the backoff passed: OTHER is written to L3 and read back from it
    monkeypatch.setattr(os, "pwritev", real)
    clock.now_s += 1.0
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    eng.cache.tree.evict(Tier.L2, eng.cache.l2.num_pages)
    assert (await run_one(eng, OTHER)).output_ids == want_other
    await eng.cache.drain()
    assert store.write_retry_in_s() == 0.0
    other = tuple(OTHER[:len(OTHER) - len(OTHER) % 4])
    only_in_l3(eng, other)
    out = await run_one(eng, OTHER)
    assert out.output_ids == want_other and out.cached_tokens.get("l3", 0) == len(other), out.cached_tokens
    eng.cache.check_integrity()
    assert_whole(eng.cache)
    await finish(eng)

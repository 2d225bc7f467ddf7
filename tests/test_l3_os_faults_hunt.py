"""The L3 file store (hicache/storage.py, storage_file.py) under real OS-level faults, not the
project's fault hooks: the OS calls the store makes (os.pwritev / os.preadv / os.ftruncate /
fcntl.flock / os.fstatvfs / os.open) made to fail or move fewer bytes than asked, and the file
itself truncated, deleted or replaced under a running engine. Each checks the request's output
against an engine without any cache, what the tree and the store account, and that the engine
keeps serving (and writing L3) once the fault clears."""
from __future__ import annotations

import errno
import fcntl
import os
import tempfile

import pytest
import torch

from hicache.geometry import KVGeometry
from hicache.ops import OpState
from hicache.radix import Tier
from hicache.storage import FileStore
from hicache_helpers import assert_whole, flip_l3_byte, make_manager, write_prefix
from test_l3_drop_hunt import _served_then_only_in_l3
from test_faults import PAGE, PROMPT, REUSABLE, finish, make_engine, only_in_l3, reference, run_one

SMALL = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)


# -- a file that lost its tail ----------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_file_truncated_inside_a_prefix_keeps_the_pages_before_its_end():
    """The L3 file is truncated under the engine to end inside page k of an L3-only prompt (whose
    slots are one extent): the read gets its first k pages whole, then the end of the file.
    Regression: the short read named every slot of its extent, so all 6 pages left L3 and the
    next request recomputed the k pages the file still held; now only the pages from the first
    one the file cannot give back leave, as for a corrupt page (tests/test_l3_drop_hunt.py)."""
    k = 3
    eng = make_engine()
    want, tokens = await _served_then_only_in_l3(eng)
    m = eng.cache.tree.match(tokens, touch=False)
    slots = [int(s) for s in m.pages[Tier.L3]]
    assert slots == list(range(slots[0], slots[0] + len(slots)))  # one extent
    bpp = eng.cache.store.bytes_per_page
    os.truncate(eng.cache.store.path, (slots[k] * bpp) + bpp // 2)  # page k only half there
    op = eng.cache.runner.start_restore(tokens, m, "l3", None)
    await eng.cache.drain()
    assert op.state is OpState.FAILED and "[short]" in op.error
    assert eng.cache.tree.match(tokens, touch=False).lengths == [0, 0, k * PAGE]
    assert_whole(eng.cache)
    out = await run_one(eng)
    assert out.output_ids == want
    assert out.cached_tokens.get("l3", 0) == k * PAGE, out.cached_tokens
    assert eng.metrics()["failures"] == {"short": 1}
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "blocking"])
async def test_a_request_whose_l3_file_lost_its_tail_gets_the_recompute_output_and_loses_only_the_tail(prefetch):
    """The same through a request (its L3 hit read by a prefetch, or by a blocking restore): the
    output is the recompute's, and only the pages past the file's end (and the answer's page under
    them) are counted missing."""
    k = 2
    eng = make_engine(prefetch=prefetch)
    want, tokens = await _served_then_only_in_l3(eng)
    m = eng.cache.tree.match(tokens, touch=False)
    before = eng.cache.tree.num_resident_pages[Tier.L3]  # the prompt's pages and the answer's
    os.truncate(eng.cache.store.path, int(m.pages[Tier.L3][k]) * eng.cache.store.bytes_per_page)
    out = await run_one(eng)
    await eng.cache.drain()
    assert out.output_ids == want and out.error is None
    metrics = eng.metrics()
    assert metrics["failures"] == {"short": 1} and metrics["storage_missing_pages"] == before - k
    only_in_l3(eng, tokens)  # the lost pages written again by the recompute's backup
    out = await run_one(eng)
    assert out.output_ids == want and out.cached_tokens.get("l3", 0) == REUSABLE, out.cached_tokens
    await finish(eng)


@pytest.mark.asyncio
async def test_every_bad_page_of_a_read_that_failed_twice_over_leaves_l3():
    """A prompt whose L3 slots are two extents (read by two I/O tasks): the file was truncated
    past the first extent (the second's pages are gone: a short read) and a page of the first was
    overwritten (its checksum fails). Regression: the read's error named only the short extent's
    slots and dropped the checksum failures the other task found, so the corrupt page kept its
    residency and the next read of the prompt failed on it again; now both leave L3."""
    mgr = make_manager()
    tokens = tuple(range(1000, 1024))
    write_prefix(mgr, tokens[:12])
    await mgr.drain()
    write_prefix(mgr, tuple(range(2000, 2012)), seed=1)  # takes the slots after the first three
    await mgr.drain()
    write_prefix(mgr, tokens, start=12, seed=2)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, mgr.l1.num_pages)
    mgr.tree.evict(Tier.L2, mgr.l2.num_pages)
    m = mgr.tree.match(tokens, touch=False)
    slots = [int(s) for s in m.pages[Tier.L3]]
    assert m.lengths == [0, 0, 24] and slots[3] != slots[2] + 1, slots  # two extents
    bpp = mgr.store.bytes_per_page
    flip_l3_byte(mgr, slots[1])
    os.truncate(mgr.store.path, min(slots[3:]) * bpp)  # the second extent is past the file's end
    op = mgr.runner.start_restore(tokens, m, "l3", "r")
    await mgr.drain()
    assert op.state is OpState.FAILED
    assert mgr.tree.match(tokens, touch=False).lengths == [0, 0, PAGE]  # only page 0 is whole
    assert_whole(mgr)
    m = mgr.tree.match(tokens, touch=False)
    op = mgr.runner.start_restore(tokens, m, "l3", "r2")  # what L3 still holds reads back
    await mgr.drain()
    assert op.succeeded, op.error
    assert dict(mgr.metrics.failures) == {"short": 1}
    assert_whole(mgr)
    await mgr.close()


# -- writes the disk refuses, then takes again --------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["enospc", "eio", "no_progress"])
async def test_a_write_the_disk_refuses_fails_clean_and_l3_is_written_once_it_clears(monkeypatch, how):
    """os.pwritev fails (a full disk: the sparse file's blocks are allocated as pages are
    written, so the start-up free-space check cannot promise them; a failing disk) or moves
    nothing: the backup fails, counted as its kind, nothing of the prompt is left in L3 or valid in
    the store, the request's output is the recompute's; once the fault clears the next backup
    writes it and it is read back."""
    real = os.pwritev
    written = []

    def pwritev(fd, buffers, offset):
        if how == "enospc":  # the first bytes fit, then the disk is full
            written.append(real(fd, [memoryview(buffers[0])[:100]], offset))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if how == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return 0

    eng = make_engine()
    await eng.start()
    eng.cache.store.enospc_backoff_s = (0.0, 0.0)  # (the backoff after ENOSPC: test_l3_reserve_hunt.py)
    want = await reference(PROMPT)
    tokens = tuple(PROMPT[:REUSABLE])
    monkeypatch.setattr(os, "pwritev", pwritev)
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    kind = {"enospc": "enospc", "eio": "eio", "no_progress": "short"}[how]
    assert eng.metrics()["failures"].get(kind, 0) >= 1, eng.metrics()["failures"]
    assert eng.cache.tree.match(tokens, touch=False).lengths[Tier.L3] == 0
    assert eng.cache.store.stats()["valid_slots"] == 0
    assert_whole(eng.cache)
    monkeypatch.setattr(os, "pwritev", real)
    eng.cache.tree.evict(Tier.L1, eng.cache.l1.num_pages)
    eng.cache.tree.evict(Tier.L2, eng.cache.l2.num_pages)
    assert (await run_one(eng)).output_ids == want  # recomputed and, now, written to L3
    await eng.cache.drain()
    only_in_l3(eng, tokens)
    out = await run_one(eng)
    assert out.output_ids == want and out.cached_tokens.get("l3", 0) == REUSABLE, out.cached_tokens
    await finish(eng)


@pytest.mark.asyncio
async def test_partial_reads_and_writes_that_progress_complete(monkeypatch):
    """os.pwritev / os.preadv move at most 1,000 bytes per call, less than a page (a busy or
    network file system may): each transfer goes on where the last stopped, nothing fails, and the
    L3 hit gives the recompute's output."""
    real_w, real_r = os.pwritev, os.preadv
    calls = {"w": 0, "r": 0}  # calls that moved less than asked

    def limited(real, key):
        def call(fd, buffers, offset):
            view = memoryview(buffers[0]).cast("B")
            calls[key] += len(view) > 1000
            return real(fd, [view[:1000]], offset)
        return call

    monkeypatch.setattr(os, "pwritev", limited(real_w, "w"))
    monkeypatch.setattr(os, "preadv", limited(real_r, "r"))
    eng = make_engine()
    want, tokens = await _served_then_only_in_l3(eng)
    out = await run_one(eng)
    assert out.output_ids == want and out.cached_tokens.get("l3", 0) == REUSABLE
    assert calls["w"] > 0 and calls["r"] > 0  # really partial
    assert eng.metrics()["failures"] == {}
    await finish(eng)


@pytest.mark.asyncio
async def test_a_read_the_disk_fails_drops_the_pages_and_they_are_written_again(monkeypatch):
    """os.preadv raises EIO (a bad sector): the request recomputes, the pages it could not read
    leave L3, and the recompute's backup writes them again, read back once the disk reads."""
    real = os.preadv

    def preadv(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    eng = make_engine()
    want, tokens = await _served_then_only_in_l3(eng)
    monkeypatch.setattr(os, "preadv", preadv)
    assert (await run_one(eng)).output_ids == want
    await eng.cache.drain()
    assert eng.metrics()["failures"] == {"eio": 1}
    assert_whole(eng.cache)
    monkeypatch.setattr(os, "preadv", real)
    only_in_l3(eng, tokens)  # written again by the recompute's backup
    out = await run_one(eng)
    assert out.output_ids == want and out.cached_tokens.get("l3", 0) == REUSABLE
    await finish(eng)


# -- the file changed under the engine --------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("change", ["deleted", "replaced"])
async def test_a_store_path_deleted_or_replaced_under_the_engine_keeps_serving(tmp_path, change):
    """The path given to the engine is deleted, or replaced by another file of garbage (a cleanup
    job, an operator's mistake): the store works on the file it opened, so L3 hits still give the
    recompute's output, and nothing is written to the new file."""
    path = tmp_path / "l3.kv"
    eng = make_engine(storage_path=str(path))
    want, tokens = await _served_then_only_in_l3(eng)
    os.unlink(path)
    if change == "replaced":
        path.write_bytes(b"\xa5" * 4096)
    out = await run_one(eng)
    assert out.output_ids == want and out.cached_tokens.get("l3", 0) == REUSABLE
    await eng.cache.drain()
    await finish(eng)
    if change == "replaced":
        assert path.read_bytes() == b"\xa5" * 4096
    else:
        assert not path.exists()


# -- start-up -----------------------------------------------------------------------------------------
def _fail_with(code: int):
    def call(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return call


@pytest.mark.parametrize("use_path", [True, False])
@pytest.mark.parametrize("target,code", [
    ((os, "ftruncate"), errno.EFBIG),  # a size over the file system's largest file (FAT32: 4 GiB)
    ((os, "fstatvfs"), errno.ENOSYS),  # a file system that cannot say its free space
    ((fcntl, "flock"), errno.ENOLCK),  # NFS without a lock manager
], ids=["ftruncate-EFBIG", "fstatvfs-ENOSYS", "flock-ENOLCK"])
def test_a_store_file_the_os_cannot_size_or_lock_is_a_clear_error(monkeypatch, tmp_path, target, code,
                                                                    use_path):
    """Regression: an OSError from sizing or locking the file escaped raw ("[Errno 27] File too
    large": no path, no flag; hicache-serve printed 'cannot start the engine: [Errno 27] File too
    large'). Now it is a ValueError naming the path, the OS's reason and the flags, and a file the
    store created is removed again."""
    if target[1] == "flock" and not use_path:
        pytest.skip("a temporary file is not locked")
    path = tmp_path / "l3.kv"
    before = set(os.listdir(tempfile.gettempdir()))
    monkeypatch.setattr(*target, _fail_with(code))
    with pytest.raises(ValueError) as exc:
        FileStore(SMALL, num_slots=4, path=str(path) if use_path else None)
    message = str(exc.value)
    assert os.strerror(code) in message and "--hicache-storage" in message, message
    if use_path:
        assert str(path) in message
        assert not path.exists()
    else:
        assert "hicache-l3-" in message
        assert not {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("hicache-l3-")}


def test_a_store_path_the_os_cannot_create_is_a_clear_error(monkeypatch, tmp_path):
    """A missing directory, a read-only file system, a path that is a directory: one ValueError
    naming the path and the reason, before anything is created."""
    with pytest.raises(ValueError, match="No such file or directory") as exc:
        FileStore(SMALL, num_slots=4, path=str(tmp_path / "missing" / "l3.kv"))
    assert str(tmp_path / "missing" / "l3.kv") in str(exc.value)
    with pytest.raises(ValueError, match="not a regular file"):
        FileStore(SMALL, num_slots=4, path=str(tmp_path))
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (_fail_with(errno.EROFS)() if str(p).endswith("ro.kv")
                                                       else real_open(p, *a, **k)))
    with pytest.raises(ValueError, match="Read-only file system"):
        FileStore(SMALL, num_slots=4, path=str(tmp_path / "ro.kv"))
    assert not (tmp_path / "ro.kv").exists()


def test_hicache_serve_names_the_store_file_the_os_cannot_size(monkeypatch, tmp_path, capsys):
    """Through hicache-serve: one line naming the L3 file and its flag, exit code 2 (it printed
    'cannot start the engine: [Errno 27] File too large')."""
    from scheduler import serve
    path = tmp_path / "l3.kv"
    monkeypatch.setattr(os, "ftruncate", _fail_with(errno.EFBIG))
    code = serve.main(["--port", "0", "--device", "cpu", "--enable-hicache", "--hicache-storage-path", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert str(path) in err and "File too large" in err and "--hicache-storage-path" in err, err
    assert not path.exists()


@pytest.mark.asyncio
async def test_a_temporary_store_file_that_cannot_be_removed_does_not_break_shutdown(monkeypatch):
    """The file system of the temporary L3 file went read-only under the engine (ext4 remounts
    read-only on an I/O error by default): writes fail, counted, and at shutdown the file cannot be
    removed. Regression: the OSError of that unlink escaped engine.shutdown(), skipping the rest of
    it (the forward runner was never closed); now it is a warning naming the file left behind. (Where /proc/self/fd
    names a descriptor the file is unlinked as it opens: here it is kept by name, as elsewhere.)"""
    from structlog.testing import capture_logs

    from hicache import storage_file
    monkeypatch.setattr(storage_file, "FD_DIR", "/nonexistent")
    eng = make_engine()
    want, tokens = await _served_then_only_in_l3(eng)
    path = eng.cache.store.path
    real_unlink = os.unlink
    monkeypatch.setattr(os, "pwritev", _fail_with(errno.EROFS))
    monkeypatch.setattr(os, "unlink", lambda p, *a, **k: (_fail_with(errno.EROFS)() if os.fspath(p) == path
                                                         else real_unlink(p, *a, **k)))
    out = await run_one(eng, PROMPT[:PAGE] + [7] * (2 * PAGE + 1))  # a new prompt: its backup fails
    assert out.error is None
    await eng.cache.drain()
    assert set(eng.metrics()["failures"]) == {"eio"}  # (EROFS: the write failed, counted)
    closed = []
    real_close = eng.runner.close
    monkeypatch.setattr(eng.runner, "close", lambda: (closed.append(True), real_close())[1])
    with capture_logs() as logs:
        await finish(eng)
    assert closed == [True]
    assert eng.cache.store.closed
    assert any(e.get("log_level") == "warning" and path in repr(e) for e in logs), logs
    monkeypatch.setattr(os, "unlink", real_unlink)
    real_unlink(path)

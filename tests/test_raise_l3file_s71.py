"""Session 71's hunt of the kept L3 file (--hicache-storage-persist, hicache/l3_index.py, hicache/storage_file.py):
what an operator does to the file and its index between runs.

Pinned here (each an index adopted against a file that does not hold what it lists: every adopted page then failed
its checksum at its first read, a failed restore and a warning per request before it recomputed; never a wrong
output, but pages adopted that are not what they claim):
- An index whose header names no file size (a hand-edited one: "file_bytes" removed or null) next to a data file
  deleted since was adopted against the new, empty file: the check compared the header's missing size (None) with
  the size found for a file that was not there (None). Now an index is never adopted where no file was found.
- A run without the flag on the path truncates the file as it opens, and deleted the index only once its cache was
  built: a start that failed in between (the copy engine, the kernel calibration, a Ctrl-C) left the truncated
  file at its old size and the old index beside it, which the next run with the flag adopted. Now the index goes as
  soon as the file is opened (truncated).
- The index's rename at its save and its deletion as it is read were not made durable (no fsync of their folder):
  after a power loss the saved index could be missing, or the one read and deleted come back next to a file
  rewritten since. Now the folder is synced after each (best effort).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from structlog.testing import capture_logs

import hicache.manager as manager_module
from hicache.l3_index import index_path
from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager
from test_l3_persist import A, B, _manager, _saved


def _edit_header(path: str, edit) -> None:
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(str(arrays.pop("header")))
    edit(header)
    with open(path, "wb") as f:
        np.savez(f, header=np.array(json.dumps(header)), **arrays)


@pytest.mark.asyncio
@pytest.mark.parametrize("edit", ["removed", "null"])
async def test_an_index_naming_no_file_size_is_not_adopted_for_a_file_deleted_since(tmp_path, edit):
    await _saved(tmp_path, A, B)
    path = index_path(str(tmp_path / "l3.kv"))
    _edit_header(path, lambda h: h.pop("file_bytes") if edit == "removed" else h.update(file_bytes=None))
    os.unlink(tmp_path / "l3.kv")
    with capture_logs() as logs:
        mgr = _manager(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0 and mgr.metrics.storage_adopted_pages == 0
    assert any(e["event"] == "l3_index_ignored" for e in logs) and not os.path.exists(path)
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_run_without_the_flag_that_fails_to_start_leaves_no_index_of_the_file_it_truncated(
        tmp_path, monkeypatch):
    await _saved(tmp_path, A)
    path = index_path(str(tmp_path / "l3.kv"))

    def refuse(*_args, **_kwargs):  # (as a copy engine or a kernel calibration that fails the start)
        raise RuntimeError("injected")
    with monkeypatch.context() as m:
        m.setattr(manager_module, "choose_backends", refuse)
        with pytest.raises(RuntimeError, match="injected"):
            make_manager(storage_path=str(tmp_path / "l3.kv"), model_id="m1")  # (no flag: truncated as it opens)
    assert not any((tmp_path / "l3.kv").read_bytes())  # (the file of the same size, zeros: its pages are gone)
    assert not os.path.exists(path)
    mgr = _manager(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0 and mgr.metrics.storage_adopted_pages == 0
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_the_index_s_rename_and_its_deletion_as_it_is_read_are_synced_to_its_folder(tmp_path, monkeypatch):
    """The folder is fsynced after the index lands by its rename, and again after the index is deleted as the
    next engine reads it: both outlive a power loss."""
    import hicache.l3_index as l3_index_module
    real_fsync, synced = os.fsync, []

    def fsync(fd):
        synced.append((os.path.isdir(f"/proc/self/fd/{fd}"), os.path.exists(index_path(str(tmp_path / "l3.kv")))))
        return real_fsync(fd)
    monkeypatch.setattr(l3_index_module.os, "fsync", fsync)
    await _saved(tmp_path, A)
    assert (True, True) in synced, "the index's rename was not synced to its folder"
    synced.clear()
    mgr = _manager(tmp_path)
    assert mgr.metrics.storage_adopted_pages > 0
    assert (True, False) in synced, "the index's deletion as it was read was not synced to its folder"
    await mgr.close()

"""Regressions from session 53's hunt of the kept L3 file (hicache/l3_index.py) against a hostile file system: an
index whose zip directory reads as encrypted is ignored (every later start failed, the file left locked), a FIFO
at the index's name or its temporary one blocks neither the start nor the save, a start that fails after adopting
the index saves it again (the next start lost the whole L3), an index that cannot be deleted as it is read is not
adopted (a later start adopted it stale), and EFBIG (a file size limit) is ENOSPC's backoff, not eio."""
from __future__ import annotations

import errno
import os

import pytest

import hicache.l3_index as l3_index
import scheduler.engine as engine_module
from hicache.l3_index import index_path
from hicache.radix import Tier
from hicache.storage import _error_from_oserror
from hicache_helpers import assert_whole
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from test_l3_persist import A, B, _manager, _saved


def _flip_encrypted_flag(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    entry = data.find(b"PK\x01\x02")  # (the first central-directory entry: its general-purpose flags at +8)
    data[entry + 8] ^= 0x01
    open(path, "wb").write(data)


@pytest.mark.asyncio
async def test_an_index_read_as_encrypted_is_ignored_and_the_file_is_not_left_locked(tmp_path):
    await _saved(tmp_path, A, B)
    path = index_path(str(tmp_path / "l3.kv"))
    _flip_encrypted_flag(path)
    mgr = _manager(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0 and not os.path.exists(path)
    assert_whole(mgr)
    await mgr.close()


def test_a_manager_that_fails_past_its_stores_open_closes_it(tmp_path, monkeypatch):
    def fail(_mgr):
        raise RuntimeError("injected")
    monkeypatch.setattr(l3_index, "load", fail)
    with pytest.raises(RuntimeError, match="injected"):
        _manager(tmp_path)
    monkeypatch.undo()
    _manager(tmp_path).abandon()  # (the file is not locked by the one that failed)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["index", "tmp"])
async def test_a_fifo_at_the_index_or_its_temporary_name_blocks_nothing(tmp_path, name):
    await _saved(tmp_path, A)
    path = index_path(str(tmp_path / "l3.kv"))
    if name == "index":
        os.unlink(path)
        os.mkfifo(path)
        mgr = _manager(tmp_path)  # (blocked in open() for good)
        assert mgr.tree.num_resident_pages[Tier.L3] == 0 and not os.path.exists(path)
    else:
        os.mkfifo(path + ".tmp")
        mgr = _manager(tmp_path)
        assert mgr.tree.match(A, touch=False).lengths[Tier.L3] == len(A)
    await mgr.close()  # (its save blocked in open() of the FIFO at .tmp for good)
    assert os.path.isfile(path) and not os.path.exists(path + ".tmp")


@pytest.mark.asyncio
async def test_a_start_that_fails_after_adopting_saves_the_index_again(tmp_path, monkeypatch):
    config = EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4).with_hicache(
        enable=True, policy="always", transfer_backend="torch", storage_path=str(tmp_path / "l3.kv"),
        storage_persist=True)
    first = Engine(config)
    await first.generate_async([list(range(10, 60))], SamplingParams(max_tokens=4))
    await first.cache.drain()
    await first.shutdown()
    saved = first.cache.tree.num_resident_pages[Tier.L3]
    assert saved > 0 and os.path.exists(index_path(str(tmp_path / "l3.kv")))

    def out_of_memory(*_args, **_kwargs):  # (as a CUDA graph capture that runs out of memory fails the start)
        raise MemoryError("injected")
    monkeypatch.setattr(engine_module, "Admission", out_of_memory)
    with pytest.raises(MemoryError):
        Engine(config)
    monkeypatch.undo()
    assert os.path.exists(index_path(str(tmp_path / "l3.kv")))
    again = Engine(config)
    assert again.metrics()["storage_adopted_pages"] == saved
    await again.shutdown()


@pytest.mark.asyncio
async def test_an_index_that_cannot_be_deleted_as_it_is_read_is_not_adopted(tmp_path, monkeypatch):
    await _saved(tmp_path, A)
    path = index_path(str(tmp_path / "l3.kv"))
    real_unlink = os.unlink

    def refuse(p, *args, **kwargs):
        if p == path:
            raise PermissionError(errno.EPERM, "Operation not permitted", p)
        return real_unlink(p, *args, **kwargs)
    monkeypatch.setattr(l3_index.os, "unlink", refuse)
    mgr = _manager(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    mgr.abandon()


def test_a_file_size_limit_is_no_room_not_an_io_error():
    assert _error_from_oserror(OSError(errno.EFBIG, "File too large"), "write").kind == "enospc"
    assert _error_from_oserror(OSError(errno.EIO, "Input/output error"), "write").kind == "eio"

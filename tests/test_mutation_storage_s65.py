"""Rules of the L3 file store (hicache/storage.py) that session 65's mutation check found unguarded: a quota
(EDQUOT) is a full disk, the constructor's and the submit path's refusals (no slots, a persistent file without
checksums, a negative slot, a host buffer not laid out as whole pages, lists of different lengths), a closed
store refusing writes as closed even while backing off, an overwrite failing leaving its slots unreadable, a
failed read naming every page of its task, and a verified read split into sub-pieces (pages over the verify
chunk, each sub-piece read from its own slots, a corrupted page named exactly)."""
from __future__ import annotations

import errno
import os

import pytest
import torch

import hicache.storage as storage
from hicache.faults import Fault, FaultInjector
from hicache.storage import FileStore, StorageError, _error_from_oserror
from test_l3_reserve_hunt import SMALL, _Clock, _enospc_pwritev
from test_storage import _flip_byte

BPP = SMALL.bytes_per_page


def _pages(num_pages: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_pages, BPP), generator=gen, dtype=torch.uint8)


# ---- errors: a quota is no room ------------------------------------------------------------------------------
def test_a_disk_quota_exceeded_is_no_room_not_an_io_error():
    """EDQUOT (the user's quota on the disk is used up) backs writes off as a full disk does (S4)."""
    assert _error_from_oserror(OSError(errno.EDQUOT, "Disk quota exceeded"), "write").kind == "enospc"
    assert _error_from_oserror(OSError(errno.ENOSPC, "No space left on device"), "write").kind == "enospc"


# ---- the constructor's refusals -----------------------------------------------------------------------------
def test_a_store_of_no_slots_is_refused(tmp_path):
    """num_slots 0 is refused by name (S5), not opened as an empty file every write to would fail."""
    with pytest.raises(ValueError, match="num_slots must be >= 1, got 0"):
        FileStore(SMALL, 0, path=tmp_path / "l3.kv")
    assert not (tmp_path / "l3.kv").exists()


def test_a_persistent_file_without_checksums_is_refused(tmp_path):
    """A persistent file's pages are adopted by a later process and only their checksums vouch for them: a
    persistent store with checksums off is refused (S6)."""
    with pytest.raises(ValueError, match="needs a path and checksums"):
        FileStore(SMALL, 4, path=tmp_path / "l3.kv", persistent=True, checksum=False)
    with pytest.raises(ValueError, match="needs a path and checksums"):
        FileStore(SMALL, 4, persistent=True)


# ---- the submit path's refusals -----------------------------------------------------------------------------
def test_a_negative_slot_is_refused_everywhere():
    """Slot -1 is out of range for every call (S14): not the last slot by numpy's wrap-around, nor a
    negative file offset failing as an I/O error."""
    with FileStore(SMALL, 4) as store:
        host = _pages(1)
        store.write_pages(host, [0], [3]).result(timeout=10)
        for call in (lambda: store.exists([-1]), lambda: store.checksums_of([-1]), lambda: store.invalidate([-1]),
                     lambda: store.write_pages(host, [0], [-1]), lambda: store.read_pages([-1], host, [0])):
            with pytest.raises(ValueError, match=r"slot out of range \[0, 4\): \[-1\]"):
                call()
        assert store.exists([3]) == [True]


def test_a_host_buffer_not_laid_out_as_whole_pages_is_refused():
    """A non-contiguous buffer of the right shape (a read would land in a copy and the caller's buffer stay
    unchanged, S18) and a buffer whose rows are wider than a page (page k is not at k * bytes_per_page, S19)
    are refused."""
    with FileStore(SMALL, 4) as store:
        store.write_pages(_pages(2), [0, 1], [0, 1]).result(timeout=10)
        strided = torch.zeros(BPP, 2, dtype=torch.uint8).t()
        assert strided.shape == (2, BPP) and not strided.is_contiguous()
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            store.read_pages([0, 1], strided, [0, 1])
        wide = torch.zeros(2, BPP + 8, dtype=torch.uint8)
        with pytest.raises(ValueError, match="store pages are"):
            store.read_pages([0, 1], wide, [0, 1])
        with pytest.raises(ValueError, match="store pages are"):
            store.write_pages(wide, [0, 1], [2, 3])
        assert store.exists([2, 3]) == [False, False]


def test_host_pages_and_slots_of_different_lengths_are_refused_even_with_no_slots():
    """A host page without a slot is refused (S20), not taken for an empty operation that did nothing."""
    with FileStore(SMALL, 4) as store:
        with pytest.raises(ValueError, match="1 host pages but 0 slots"):
            store.write_pages(_pages(1), [0], [])
        with pytest.raises(ValueError, match="0 host pages but 1 slots"):
            store.read_pages([0], _pages(1), [])


# ---- close and the ENOSPC back-off --------------------------------------------------------------------------
def test_a_closed_store_refuses_writes_as_closed_while_backing_off(tmp_path, monkeypatch):
    """After an ENOSPC the store backs off; once closed, a write is refused as "closed" (raised at once, as
    every call on a closed store is), not as a pause that a caller would retry later (S8)."""
    store = FileStore(SMALL, 4, path=tmp_path / "l3.kv")
    store.clock = _Clock()
    host = _pages(1)
    with monkeypatch.context() as m:
        m.setattr(os, "pwritev", _enospc_pwritev([]))
        with pytest.raises(StorageError, match="enospc"):
            store.write_pages(host, [0], [0]).result(timeout=10)
    assert store.write_retry_in_s() == 1.0
    store.close()
    with pytest.raises(StorageError) as info:
        store.write_pages(host, [0], [0])
    assert info.value.kind == "closed"


def test_a_bad_write_is_refused_as_bad_while_backing_off(tmp_path, monkeypatch):
    """While writes pause after an ENOSPC, a write with bad arguments is refused for them (ValueError, at once),
    as at any other time, not answered "enospc" as if a retry later could succeed (session 66's fix). A good
    write is still paused, and goes ahead once the pause ends."""
    store = FileStore(SMALL, 4, path=tmp_path / "l3.kv")
    store.clock = clock = _Clock()
    host = _pages(2)
    with monkeypatch.context() as m:
        m.setattr(os, "pwritev", _enospc_pwritev([]))
        with pytest.raises(StorageError, match="enospc"):
            store.write_pages(host, [0], [0]).result(timeout=10)
    assert store.write_retry_in_s() > 0
    for host_pages, slots, message in (([0], [4], "slot out of range"), ([0], [-1], "slot out of range"),
                                       ([2], [0], "host page out of range"), ([0, 1], [0], "2 host pages but 1"),
                                       ([0, 1], [1, 1], "duplicate destination slots")):
        with pytest.raises(ValueError, match=message):
            store.write_pages(host, host_pages, slots)
    with pytest.raises(StorageError, match="paused after ENOSPC"):
        store.write_pages(host, [0], [0]).result(timeout=10)
    clock.now_s += store.write_retry_in_s()
    store.write_pages(host, [0, 1], [0, 1]).result(timeout=10)
    assert store.exists([0, 1, 2]) == [True, True, False]
    store.close()


# ---- an overwrite that fails ---------------------------------------------------------------------------------
@pytest.mark.parametrize("checksum", [True, False])
def test_an_overwrite_that_fails_leaves_its_slots_unreadable(checksum):
    """A slot being written again holds no valid page from the write's submission on (S24): when the write
    fails half way, the slot is not left "valid" with the old page's checksum over torn bytes (a read then
    fails as a checksum error after the cache counted an L3 hit), nor, without checksums, readable as the
    half-written garbage."""
    faults = FaultInjector()
    with FileStore(SMALL, 4, faults=faults, checksum=checksum) as store:
        store.write_pages(_pages(2, seed=1), [0, 1], [0, 1]).result(timeout=10)
        assert store.exists([0, 1]) == [True, True]
        faults.arm(Fault.SHORT_WRITE, times=1)
        with pytest.raises(StorageError, match="short"):
            store.write_pages(_pages(2, seed=2), [0, 1], [0, 1]).result(timeout=10)
        assert store.exists([0, 1]) == [False, False]
        assert store.stats()["valid_slots"] == 0


# ---- a failed read names its pages ---------------------------------------------------------------------------
def test_a_read_failing_in_its_first_piece_names_every_page_of_the_later_pieces():
    """One I/O task reading three extents that fails on the first names every slot of the three (S39), the
    last page of the last extent too: a slot left out stays resident in L3 and fails the next read again."""
    faults = FaultInjector()
    with FileStore(SMALL, 16, io_workers=1, faults=faults) as store:
        host = _pages(7)
        slots = [0, 1, 4, 5, 6, 9, 10]
        store.write_pages(host, range(7), slots).result(timeout=10)
        faults.arm(Fault.EIO_READ, times=1)
        with pytest.raises(StorageError) as info:
            store.read_pages(slots, torch.zeros_like(host), range(7)).result(timeout=10)
        assert info.value.kind == "eio"
        assert sorted(info.value.bad_slots) == slots


# ---- verified reads in sub-pieces ----------------------------------------------------------------------------
def test_pages_larger_than_the_verify_chunk_are_read_one_at_a_time(monkeypatch):
    """A page larger than VERIFY_CHUNK_BYTES (8 MiB: a large model's page) is read and verified one page per
    sub-piece (S40): a step of 0 pages would fail every read of the store with a ValueError."""
    monkeypatch.setattr(storage, "VERIFY_CHUNK_BYTES", BPP // 2)
    with FileStore(SMALL, 8) as store:
        host = _pages(3, seed=3)
        store.write_pages(host, range(3), [2, 3, 4]).result(timeout=10)
        back = torch.zeros_like(host)
        store.read_pages([2, 3, 4], back, range(3)).result(timeout=10)
        assert torch.equal(back, host)


def test_a_read_split_into_verify_chunks_reads_each_from_its_own_slots(monkeypatch):
    """A verified read longer than a verify chunk reads each sub-piece from its own slots (S43) and names a
    corrupted page by its own slot, not the sub-piece's first or the extent's first (S44); two corrupted pages
    in one chunk are both named (S45)."""
    monkeypatch.setattr(storage, "VERIFY_CHUNK_BYTES", 3 * BPP)
    with FileStore(SMALL, 16) as store:
        host = _pages(8, seed=4)
        slots = list(range(5, 13))
        store.write_pages(host, range(8), slots).result(timeout=10)
        back = torch.zeros_like(host)
        result = store.read_pages(slots, back, range(8)).result(timeout=10)
        assert torch.equal(back, host) and result.num_extents == 1
        _flip_byte(store.path, store.offset(10) + 5)  # the last page of the second chunk (slots 8, 9, 10)
        with pytest.raises(StorageError) as info:
            store.read_pages(slots, torch.zeros_like(host), range(8)).result(timeout=10)
        assert info.value.kind == "checksum" and info.value.bad_slots == (10,)
        _flip_byte(store.path, store.offset(12) + 7)  # and the last page of the third chunk (slots 11, 12)
        _flip_byte(store.path, store.offset(11))
        with pytest.raises(StorageError) as info:
            store.read_pages(slots, torch.zeros_like(host), range(8)).result(timeout=10)
        assert info.value.bad_slots == (10, 11, 12)

"""Session 68's second mutation check of the L3 file side (hicache/storage_file.py, storage_op.py, l3_index.py,
page_keys.py, suspect.py): the rules no earlier test pinned (first passes: test_mutation_storage_s56/_s65,
test_mutation_l3_s61, test_mutation_redis_s64, test_mutation_cost_s64), one fast test each: a kept file cut back to
its new size when its reservation fails; a read landed "at once" still reporting a landing; no hashing with checksums
off; an index of 2-D tokens ignored; the index and the L3 file fsynced before the index takes its name; the content
keys' keyer answering a longer range of a cached prompt whole, refusing a range before token 0, salting `extra`, and
its cache's hits and evictions; hints evicting older hints but never the head they hang from, and refusing a present
length inside a page; a simulated manager dropping a suspect prefix without zeroing pages it has not. Each test names
the mutant (harness id) it kills."""
from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
import torch

from hicache.geometry import KVGeometry
from hicache.l3_index import index_path
from hicache.page_keys import PageKeyer, kv_salt, page_keys, publish_l3_hints
from hicache.radix import Tier
from hicache.storage import FileStore
from hicache.storage_file import open_store_file, release_file
from hicache.storage_op import StorageOp
from hicache_helpers import assert_whole, make_manager
from test_mutation_cost_s64 import _edit, _manager
from test_mutation_cost_s64 import _saved as save_prefixes
from test_storage import SMALL, _random_pages

PAGE_BYTES = 4096
A = tuple(range(100, 132))  # 8 pages of 4 tokens
B = A[:16] + tuple(range(500, 516))  # shares A's first 4 pages: nodes [shared, A's tail, B's tail]


# ---- storage_file ---------------------------------------------------------------------------------------
def test_a_kept_file_whose_smaller_reservation_fails_is_cut_to_its_new_size(tmp_path, monkeypatch):
    """A persistent file reopened smaller whose reservation fails (a sparse file on a full disk) is cut back to what
    was kept, the new size: not grown back to its old length with a zeroed tail, which the next start at the old
    size would find "the same size as saved" and adopt (SF7)."""
    path = tmp_path / "l3.kv"
    fd, _, _ = open_store_file(path, 8 * PAGE_BYTES, keep=True)
    os.pwrite(fd, b"\x5a" * (8 * PAGE_BYTES), 0)
    release_file(fd, None)

    def posix_fallocate(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", posix_fallocate)
    with pytest.raises(ValueError, match="No space left on device"):
        open_store_file(path, 4 * PAGE_BYTES, keep=True)
    assert path.read_bytes() == b"\x5a" * (4 * PAGE_BYTES)


# ---- storage_op -----------------------------------------------------------------------------------------
class _Store:
    """What a StorageOp reads of its FileStore (as test_mutation_l3_s61's)."""
    checksum, bytes_per_page = True, 100

    def __init__(self) -> None:
        self._state_lock, self._held = threading.Lock(), set()


def test_a_read_verified_after_landing_reports_a_landing_even_at_its_first_start():
    """until_landed_ns 0 means "no landing measured" (the cost model then learns the whole read): a read verified
    after its landing always reports at least 1 ns, even where its landing is stamped no later than its first
    task's start (SO11)."""
    op = StorageOp(_Store(), True, None, None, np.arange(2), num_tasks=1, num_extents=1,
                   expected=np.zeros(2, dtype=np.uint64), gens=None, checksums_after_landing=True)
    op.started(time.monotonic_ns() + 10**12)  # (stamped after the landing below)
    op.task_landed()
    op.task_done(None, op._first_start_ns)
    assert op.future.result(timeout=5).until_landed_ns == 1



def test_a_store_without_checksums_hashes_no_write():
    """checksum=False: a write hashes nothing (the hashing is the cost the flag saves) and publishes no checksum
    (checksums_of: 0 where none was taken) (SO13)."""
    with FileStore(SMALL, num_slots=4, checksum=False) as s:
        s.write_pages(_random_pages(SMALL, 2, seed=3), range(2), range(2)).result(timeout=10)
        assert s.checksums_of([0, 1]).tolist() == [0, 0]


# ---- l3_index -------------------------------------------------------------------------------------------
async def _saved(tmp_path, *prefixes) -> str:
    """A manager that wrote `prefixes` through to L3 and closed cleanly (test_mutation_cost_s64's); its index's path."""
    await save_prefixes(tmp_path, *prefixes)
    return index_path(str(tmp_path / "l3.kv"))


@pytest.mark.asyncio
async def test_an_index_whose_tokens_are_rows_not_a_list_is_ignored(tmp_path):
    """An index whose tokens array is 2-D (48 rows of one token: its length, and every count, still add up):
    ignored, the engine starts with an empty, whole L3 and the index gone, not a start failing on a path of lists
    the tree cannot hash (LI10; session 64's test_an_index_that_does_not_add_up_is_ignored has the other damages)."""
    path = await _saved(tmp_path, A, B)
    _edit(tmp_path, lambda a, h: a.update(tokens=a["tokens"].reshape(-1, 1)))
    mgr = _manager(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0 and mgr.metrics.storage_adopted_pages == 0
    assert not os.path.exists(path)
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_the_index_and_the_file_reach_the_disk_before_the_index_takes_its_name(tmp_path, monkeypatch):
    """The index lands whole or not at all: the L3 file and the index's temporary file are both fsynced before the
    rename gives the index its name (a power cut after the rename must not leave an index naming pages, or an
    index of its own, that never reached the disk) (LI3; the file's own fsync: LI2)."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc/self/fd here")
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", os.fspath(src))),
                                                         real_replace(src, dst))[1])
    path = await _saved(tmp_path, A)
    tmp, renamed = path + ".tmp", events.index(("replace", path + ".tmp"))
    assert ("fsync", tmp) in events[:renamed] and ("fsync", str(tmp_path / "l3.kv")) in events[:renamed]


# ---- page_keys ------------------------------------------------------------------------------------------
GEOM4 = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
SALT = kv_salt("m", GEOM4)


def test_the_keyer_answers_a_longer_range_of_the_same_tokens_with_every_page_s_key():
    """One prompt's keys asked for its first page, then its first two: the second answer has both pages' keys,
    not the cached chain of one (the cache keys by the tokens up to the range's end only, PK6)."""
    tokens = list(range(40, 52))
    keyer = PageKeyer(SALT, 4)
    assert keyer.keys(tokens, 0, 4) == page_keys(SALT, tokens, 0, 4, 4)
    assert keyer.keys(tokens, 0, 8) == page_keys(SALT, tokens, 0, 8, 4)
    assert keyer.keys(tokens, 4, 12) == page_keys(SALT, tokens, 4, 12, 4)


def test_a_key_range_starting_before_token_0_is_refused():
    """A range from token -4 is outside the tokens (its "first key" would be h_0, the salt's own hash), PK8."""
    with pytest.raises(ValueError, match="outside"):
        page_keys(SALT, list(range(16)), -4, 8, 4)
    with pytest.raises(ValueError, match="outside"):
        PageKeyer(SALT, 4).keys(list(range(16)), -4, 8)


def test_an_extra_part_of_the_salt_changes_every_key():
    """kv_salt's `extra` (anything else that changes a page's bytes) makes the salt, and so every key, another
    (PK3: it was dropped from the salt)."""
    tokens = list(range(8))
    assert not set(page_keys(kv_salt("m", GEOM4, extra="lora=a"), tokens, 0, 8, 4)) & set(
        page_keys(SALT, tokens, 0, 8, 4))


def test_the_keyer_reuses_the_same_range_and_keeps_its_latest_use():
    """The cache's costs: the same range asked twice is a hit (not a second hashing of the chain, PK15), and a hit
    is the most recent entry, so a new chain evicts the entry unused longest (PK16); a chain extending a cached
    one replaces it, so it evicts nothing else (PK25)."""
    x, y, z = [1] * 8, [2] * 8, [3] * 8
    keyer = PageKeyer(SALT, 4, cache_entries=2)
    keyer.keys(x, 0, 8)
    keyer.keys(y, 0, 8)
    keyer.keys(x, 0, 8)
    assert (keyer.hits, keyer.misses) == (1, 2)
    keyer.keys(z, 0, 8)  # evicts y
    keyer.keys(x, 0, 8)
    assert (keyer.hits, keyer.misses) == (2, 3)
    keyer = PageKeyer(SALT, 4, cache_entries=2)  # an extension takes its prefix's entry, not another's (PK25)
    keyer.keys(y, 0, 8)
    keyer.keys(x, 0, 4)
    keyer.keys(x, 0, 8)
    keyer.keys(y, 0, 8)
    assert (keyer.hits, keyer.misses) == (1, 3)


@pytest.mark.asyncio
async def test_hints_for_a_new_prompt_take_the_place_of_older_unused_hints():
    """A hint table (the L3 slots) full of another prompt's unused hints: a refresh finding the new prompt's 4 pages
    in the shared store hints all 4, evicting the older ones, rather than none for want of free slots (PK22)."""
    mgr = make_manager(storage_pages=4)
    x, y = tuple(range(16)), tuple(range(100, 116))
    assert publish_l3_hints(mgr, x, 16) == (4, 0)
    assert mgr.allocator(Tier.L3).num_free == 0
    assert publish_l3_hints(mgr, y, 16) == (4, 0)
    assert mgr.tree.match(y, include_storage=True, touch=False).lengths[Tier.L3] == 16
    await mgr.close()


@pytest.mark.asyncio
async def test_a_present_length_inside_a_page_is_refused():
    """publish_l3_hints names whole pages: a present length of 6 tokens (pages of 4) is a caller's bug, refused,
    rather than hinting the first page as if 4 had been said (PK20)."""
    mgr = make_manager(storage_pages=4)
    with pytest.raises(ValueError, match="page-aligned"):
        publish_l3_hints(mgr, tuple(range(16)), 6)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    await mgr.close()


@pytest.mark.asyncio
async def test_new_hints_never_evict_the_hinted_head_they_hang_from():
    """A full hint table whose least recently used hints are the head of the very prompt being hinted further: the
    allocation of the new pages evicts another prompt's hint, never that head (it is locked meanwhile), and the whole
    prompt ends up hinted (PK24)."""
    mgr = make_manager(storage_pages=4)
    x, z = tuple(range(16)), tuple(range(200, 204))
    assert publish_l3_hints(mgr, x[:8], 8) == (2, 0)  # x's head: the oldest hints
    assert publish_l3_hints(mgr, z, 4) == (1, 0)
    assert publish_l3_hints(mgr, x, 16) == (2, 0)
    assert mgr.tree.match(x, include_storage=True, touch=False).lengths[Tier.L3] == 16
    assert mgr.tree.match(z, include_storage=True, touch=False).lengths[Tier.L3] == 0
    await mgr.close()


# ---- suspect --------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_simulated_manager_drops_a_suspect_prefix_without_zeroing_pages_it_has_not():
    """A simulated manager's L1 pool holds no K/V (bookkeeping only): a suspect prefix's L1 pages leave the tree with
    nothing zeroed, not an IndexError from the empty pool (SU8)."""
    from hicache.config import HiCacheConfig
    from hicache.manager import CacheManager
    from hicache.suspect import drop_suspect_prefix
    mgr = CacheManager(GEOM4, 16, "cpu", HiCacheConfig(enable=True, host_size_gb=32 * GEOM4.bytes_per_page / 2**30),
                       simulate=True)
    claim = mgr.new_claim("writer")
    mgr.insert_l1(A[:8], mgr.alloc_l1(2, claim), claim, 0)
    mgr.release_claim(claim)
    await mgr.drain()  # (its backups let go of it)
    dropped, kept = drop_suspect_prefix(mgr, A[:8])
    assert (dropped["l1"], kept) == (2, 0)
    assert mgr.tree.num_resident_pages[Tier.L1] == 0
    await mgr.close()

"""Session 71: the file L3's per-slot checksums are bound to the prefix each page was computed for
(hicache/storage.py `bound_checksums`: xxh3-64 of the page XOR the digest of its PageKeyer chain key, salted
with the model and KV layout, as a Redis value's header binds it to its key).

The checksum used to be of the page's bytes alone, so nothing tied a slot to its prefix:
- a kept index whose `parents` were edited (the slots and checksums left alone) adopted real pages under a
  prefix they were not computed for, and a prompt starting with those tokens got another prefix's KV: a wrong
  greedy output;
- a tree node mapped to another prefix's slot (an internal mix-up) read that prefix's valid page and passed.
Now both fail their checksum ("checksum", counted), the pages leave L3 and the request recomputes: the output
is a no-cache engine's. An index saved by the old code (format v1: unbound values) is ignored with one warning.
Checksums off (--hicache-disable-checksum) binds nothing, as before.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from hicache.geometry import KVGeometry
from hicache.l3_index import index_path
from hicache.page_keys import kv_salt, page_keys
from hicache.radix import Tier
from hicache.storage import FileStore, StorageError, page_checksum
from hicache_helpers import assert_whole
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from test_l3_persist import A, B, _manager, _saved
from test_l3_persist_hunt import _config, _end, _serve
from test_raise_l3file_s71 import _edit_header

HEAD = [(11 * i + 7) % 200 + 5 for i in range(16)]  # 4 pages of 4 tokens, shared
PROMPTS = [HEAD + [(13 * i + 3 + 50 * k) % 200 + 5 for i in range(21)] for k in range(2)]  # 9 whole pages each
PROBE = PROMPTS[0][16:] + [9, 10, 11]  # starts with PROMPTS[0]'s own 5 pages, as a prompt of its own


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs (4 tokens) of PROMPTS and PROBE from an engine without hicache or a prefix cache."""
    async def run():
        eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4, enable_prefix_cache=False))
        outs = [(await eng.generate_async([p], SamplingParams(max_tokens=4)))[0].output_ids
                for p in [*PROMPTS, PROBE]]
        await eng.shutdown()
        return outs
    return asyncio.run(run())


async def _kept(path) -> None:
    """An engine served PROMPTS (written through to L3) and closed cleanly: the index lies next to the file."""
    eng = Engine(_config(path))
    await _serve(eng, PROMPTS)
    await _end(eng)


@pytest.mark.asyncio
async def test_an_index_re_parented_to_the_root_serves_no_page_under_a_prefix_it_was_not_computed_for(
        tmp_path, reference):
    """Every node of the kept index made a root node (`parents` -1): PROMPTS' own tails are adopted at root
    level, and PROBE (starting with PROMPTS[0]'s tail) matches them in L3. Their bound checksums fail (PROBE's
    keys are not the keys they were written under): the restore fails, counted, the pages leave L3, and PROBE
    is recomputed, the no-cache engine's output (regression: restored, a wrong output)."""
    path = tmp_path / "l3.kv"
    await _kept(path)
    with np.load(index_path(str(path)), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    assert (arrays["parents"] >= 0).any()  # (children to re-parent)
    arrays["parents"] = np.full_like(arrays["parents"], -1)
    with open(index_path(str(path)), "wb") as f:
        np.savez(f, **arrays)
    eng = Engine(_config(path))
    assert eng.cache.tree.match(PROBE, touch=False).lengths[Tier.L3] >= 16  # (adopted under PROBE's head)
    [out] = await _serve(eng, [PROBE])
    assert out.output_ids == reference[2]
    assert out.cached_tokens.get("l3", 0) == 0, out.cached_tokens
    assert eng.metrics()["failures"].get("checksum", 0) >= 1
    assert eng.metrics()["storage_missing_pages"] >= 4
    assert [o.output_ids for o in await _serve(eng, [PROBE, *PROMPTS])] == [reference[2], *reference[:2]]
    await _end(eng)


@pytest.mark.asyncio
async def test_a_node_given_another_prefix_s_slots_fails_their_check_and_recomputes(tmp_path, reference):
    """Two prefixes in L3 alone (adopted after a restart) below a shared head: their tails' L3 slots swapped in
    the tree (as a bug mapping a node to the wrong slot would): serving PROMPTS[0] reads PROMPTS[1]'s valid
    pages for its tail, which fail their check bound to PROMPTS[0]'s keys; recomputed, the no-cache output
    (regression: they passed the bytes' checksum and were restored)."""
    path = tmp_path / "l3.kv"
    await _kept(path)
    eng = Engine(_config(path))
    head = eng.cache.tree.root.children[tuple(HEAD[:4])]
    assert list(head.key) == HEAD
    tails = [head.children[tuple(p[16:20])] for p in PROMPTS]
    assert [len(t.pages[Tier.L3]) for t in tails] == [5, 5]
    tails[0].pages[Tier.L3], tails[1].pages[Tier.L3] = tails[1].pages[Tier.L3], tails[0].pages[Tier.L3]
    assert eng.cache.tree.match(PROMPTS[0], touch=False).lengths == [0, 0, 36]
    [out] = await _serve(eng, PROMPTS[:1])
    assert out.output_ids == reference[0]
    assert out.cached_tokens.get("l3", 0) < 36, out.cached_tokens
    assert eng.metrics()["failures"].get("checksum", 0) >= 1
    assert [o.output_ids for o in await _serve(eng, PROMPTS)] == reference[:2]
    await _end(eng)


@pytest.mark.asyncio
async def test_an_index_saved_by_the_old_code_is_ignored_with_one_warning(tmp_path):
    """A v1 index (its checksums of the bytes alone: no read under a bound check would pass) is not adopted:
    one warning naming its format, the index gone, L3 empty and whole."""
    await _saved(tmp_path, A, B)
    path = index_path(str(tmp_path / "l3.kv"))
    _edit_header(path, lambda h: h.update(format="hicache-l3-index-v1"))
    with capture_logs() as logs:
        mgr = _manager(tmp_path)
    ignored = [e for e in logs if e["event"] == "l3_index_ignored"]
    assert len(ignored) == 1 and "hicache-l3-index-v1" in ignored[0]["reason"], ignored
    assert mgr.tree.num_resident_pages[Tier.L3] == 0 and mgr.metrics.storage_adopted_pages == 0
    assert "hicache-l3-index-v1" not in json.dumps([e for e in logs if e["event"] != "l3_index_ignored"])
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.parametrize("checksum", [True, False])
def test_a_slot_read_under_another_prefix_s_keys_fails_unless_checksums_are_off(tmp_path, checksum):
    """The store itself: a page written under prefix A's keys reads back under them, and fails ("checksum",
    its slot named) under B's; what `checksums_of` keeps is bound (not the bytes' checksum). With checksums off
    no key binds anything (reads go through, as before)."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    salt = kv_salt("m1", geometry)
    store = FileStore(geometry, 8, checksum=checksum, key_salt=salt)
    try:
        assert store.binds_keys is checksum
        keys_a, keys_b = page_keys(salt, A, 0, 8, 4), page_keys(salt, B, 16, 24, 4)
        assert not checksum or store.page_keys(A, 0, 8) == keys_a
        src = torch.randn(geometry.page_major_shape(2))
        store.write_pages(src, [0, 1], [3, 4], keys=keys_a).result(timeout=20)
        dst = torch.zeros_like(src)
        store.read_pages([3, 4], dst, [0, 1], keys=keys_a).result(timeout=20)
        assert torch.equal(dst, src)
        if not checksum:
            store.read_pages([3, 4], dst, [0, 1], keys=keys_b).result(timeout=20)
            return
        page = memoryview(src[0].contiguous().view(torch.uint8).numpy()).cast("B")
        assert int(store.checksums_of([3])[0]) != page_checksum(page)
        with pytest.raises(StorageError) as err:
            store.read_pages([3, 4], dst, [0, 1], keys=[keys_a[0], keys_b[1]]).result(timeout=20)
        assert err.value.kind == "checksum" and err.value.bad_slots == (4,)
    finally:
        store.close()

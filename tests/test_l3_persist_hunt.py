"""A bug hunt of the L3 file kept across restarts (--hicache-storage-persist, hicache/l3_index.py): what an
operator does between runs (a run without the flag, a file deleted or truncated, a crash, a reset, another L3
size), the write policies, cache_salt, prefetches and in-flight writes at shutdown, the server stopped and
started on the same path. Every run ends whole (assert_whole), and every engine's greedy outputs equal a
no-cache engine's."""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import threading

import pytest
import torch

from hicache.l3_index import index_path
from hicache.radix import Tier
from hicache_helpers import WriteGate, assert_whole, make_manager, write_prefix
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

A = tuple(range(100, 132))  # 8 pages of 4 tokens
B = tuple(range(300, 332))
PROMPTS = [[(7 * i + 3 + k) % 200 + 5 for i in range(33 + 4 * k)] for k in range(3)]  # 8, 9, 10 whole pages


def _manager(path, storage_pages: int = 64, persist: bool = True, **config):
    return make_manager(storage_pages=storage_pages, storage_path=str(path), storage_persist=persist,
                        model_id="m1", **config)


def _l1_bytes(mgr, tokens) -> torch.Tensor:
    return mgr.l1.kv[:, :, mgr.tree.match(tokens, touch=False).pages[Tier.L1]].clone()


async def _write(mgr, tokens, seed: int = 0) -> torch.Tensor:
    """tokens written through to L3 (random K/V); their L1 bytes."""
    write_prefix(mgr, tokens, seed=seed)
    await mgr.drain()
    assert mgr.tree.match(tokens, touch=False).lengths[Tier.L3] == len(tokens)
    return _l1_bytes(mgr, tokens)


async def _restored(mgr, tokens) -> torch.Tensor | None:
    """tokens restored from L3 alone (L1 and L2 emptied first): their L1 bytes, None if the restore failed."""
    mgr.tree.evict(Tier.L1, mgr.l1.num_pages)
    mgr.tree.evict(Tier.L2, mgr.l2.num_pages)
    m = mgr.match(tokens)
    assert m.lengths == [0, 0, len(tokens)]
    op = mgr.runner.start_restore(tokens, m, "l3", "r")
    await mgr.runner.wait_op(op)
    await mgr.drain()
    return _l1_bytes(mgr, tokens) if op.succeeded else None


# -- an index that no longer describes its file -------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_run_without_the_flag_on_the_path_leaves_no_index_for_the_next_run(tmp_path):
    """(regression: a run without --hicache-storage-persist truncated and rewrote the file but left the last
    clean close's index, which the next run with the flag adopted: every one of its hits then failed its
    checksum, a failed read and a recompute each)"""
    path = tmp_path / "l3.kv"
    mgr = _manager(path)
    await _write(mgr, A)
    await mgr.close()
    mgr = _manager(path, persist=False)
    assert not os.path.exists(index_path(str(path)))
    await _write(mgr, B, seed=1)
    await mgr.close()
    mgr = _manager(path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0 and mgr.metrics.storage_adopted_pages == 0
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("change", ["deleted", "truncated"])
async def test_an_index_whose_file_was_deleted_or_truncated_is_ignored(tmp_path, change):
    """(regression: the file removed, or cut short, between runs (an operator clearing the cache by
    `rm PATH`) and the index left: the next run adopted it over a file of zeros, and every hit failed its
    checksum)"""
    path = tmp_path / "l3.kv"
    mgr = _manager(path)
    await _write(mgr, A)
    await mgr.close()
    if change == "deleted":
        os.unlink(path)
    else:
        os.truncate(path, 2 * mgr.store.bytes_per_page)
    mgr = _manager(path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    assert not os.path.exists(index_path(str(path)))
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_start_with_a_larger_l3_refused_for_want_of_space_keeps_the_file_for_the_next(tmp_path, monkeypatch):
    """(regression: the refused start emptied the kept file, as it gives back a temporary file's partial
    reservation, and with it the prefixes the next start with the old size would have adopted)"""
    path = tmp_path / "l3.kv"
    mgr = _manager(path)
    want = await _write(mgr, A)
    await mgr.close()
    with monkeypatch.context() as m:
        m.setattr(os, "posix_fallocate", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "no space")))
        with pytest.raises(ValueError, match="space"):
            _manager(path, storage_pages=128)
    mgr = _manager(path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 8
    assert torch.equal(await _restored(mgr, A), want)
    assert_whole(mgr)
    await mgr.close()


# -- the manager across restarts ------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_process_that_dies_after_adopting_leaves_its_successor_an_empty_whole_l3(tmp_path):
    """A clean close, a run that adopts and then dies (its store closed, no manager close: no index), and
    the next run: it starts empty (the index went as it was read), keeps the file, and is whole."""
    path = tmp_path / "l3.kv"
    mgr = _manager(path)
    await _write(mgr, A)
    await mgr.close()
    mgr = _manager(path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 8
    await _write(mgr, B, seed=1)
    await mgr.drain(cancel=True)
    mgr.store.close()  # (died: no index saved)
    assert not os.path.exists(index_path(str(path))) and os.path.getsize(path) > 0
    mgr = _manager(path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    assert_whole(mgr)
    await _write(mgr, A, seed=2)  # (and the file takes writes again)
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_two_restarts_without_a_request_keep_the_pages_and_their_lru_order(tmp_path):
    path = tmp_path / "l3.kv"
    mgr = _manager(path)
    want = [await _write(mgr, A), await _write(mgr, B, seed=1)]
    await mgr.close()
    for _ in range(2):
        mgr = _manager(path)
        assert mgr.tree.num_resident_pages[Tier.L3] == 16
        assert_whole(mgr)
        await mgr.close()
    mgr = _manager(path)
    assert torch.equal(await _restored(mgr, B), want[1])
    assert torch.equal(await _restored(mgr, A), want[0])
    await mgr.close()
    mgr = _manager(path)  # B was used before A: B is the older one now
    mgr.tree.evict(Tier.L3, 1)
    assert mgr.tree.match(B, touch=False).lengths[Tier.L3] == 0 and mgr.tree.match(A, touch=False).lengths[Tier.L3] == 32
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_adopted_slots_evicted_and_rewritten_keep_no_stale_checksum_or_index_entry(tmp_path):
    """An L3 of 8 slots holding A (adopted); B's write evicts A and takes its slots; after another restart
    the file holds B alone, read back byte for byte, and A is nowhere (its slots' old checksums gone)."""
    path = tmp_path / "l3.kv"
    mgr = _manager(path, storage_pages=8)
    await _write(mgr, A)
    await mgr.close()
    mgr = _manager(path, storage_pages=8)
    slots_a = mgr.tree.match(A, touch=False).pages[Tier.L3]
    want_b = await _write(mgr, B, seed=1)
    assert mgr.tree.match(A, touch=False).lengths[Tier.L3] == 0
    assert sorted(mgr.tree.match(B, touch=False).pages[Tier.L3]) == sorted(slots_a)
    assert_whole(mgr)
    await mgr.close()
    mgr = _manager(path, storage_pages=8)
    assert mgr.tree.match(A, touch=False).lengths == [0, 0, 0]
    assert torch.equal(await _restored(mgr, B), want_b)
    assert not any(mgr.metrics.failures.values())
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_larger_l3_on_restart_adopts_everything_and_fills_the_new_slots(tmp_path):
    path = tmp_path / "l3.kv"
    mgr = _manager(path, storage_pages=16)
    want = [await _write(mgr, A), await _write(mgr, B, seed=1)]
    await mgr.close()
    mgr = _manager(path, storage_pages=64)
    assert mgr.tree.num_resident_pages[Tier.L3] == 16
    c = tuple(range(600, 600 + 4 * 12))  # 12 pages more: past the old file's 16
    write_prefix(mgr, c, seed=2)
    await mgr.drain()
    assert mgr.tree.match(c, touch=False).lengths[Tier.L3] == len(c)
    assert max(mgr.tree.match(c, touch=False).pages[Tier.L3]) >= 16
    assert torch.equal(await _restored(mgr, A), want[0]) and torch.equal(await _restored(mgr, B), want[1])
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_an_index_of_another_page_size_is_ignored(tmp_path):
    path = tmp_path / "l3.kv"
    mgr = _manager(path)
    await _write(mgr, A)
    await mgr.close()
    mgr = _manager(path, page_size=8)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0 and not os.path.exists(index_path(str(path)))
    assert_whole(mgr)
    await mgr.close()


# -- engines across restarts ----------------------------------------------------------------------------------
def _config(path, max_running: int = 64, **hicache) -> EngineConfig:
    hicache = {"policy": "always", **hicache}
    return EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=4, max_running_requests=max_running
                        ).with_hicache(enable=True, transfer_backend="torch", storage_path=str(path),
                                       storage_persist=True, **hicache)


@pytest.fixture(scope="module")
def reference():
    """PROMPTS' greedy outputs (4 tokens) from an engine without hicache or a prefix cache."""
    async def run():
        eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4, enable_prefix_cache=False))
        outs = [(await eng.generate_async([p], SamplingParams(max_tokens=4)))[0].output_ids for p in PROMPTS]
        await eng.shutdown()
        return outs
    return asyncio.run(run())


async def _serve(eng, prompts=PROMPTS, salt: str | None = None, together: bool = False):
    params = SamplingParams(max_tokens=4, cache_salt=salt)
    if together:
        return await eng.generate_async(list(prompts), params)
    return [(await eng.generate_async([p], params))[0] for p in prompts]


async def _end(eng, grace_s: float = 0.0) -> None:
    await eng.cache.drain()
    await eng.stop_loop()
    assert_whole(eng.cache)
    await eng.shutdown(grace_s=grace_s)


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy, policy", [("write_through", "cost"), ("write_back", "always"),
                                                  ("write_through_selective", "always")])
async def test_each_write_policy_restarts_on_what_its_last_run_saved(tmp_path, reference, write_policy, policy):
    """write_through under the cost policy, write_back (saved within the shutdown grace) and
    write_through_selective (what it chose to save: the prompts hit twice): the next engine serves them
    from L3, outputs equal to a no-cache engine's. Under the cost policy the next engine prices with the
    samples the last one timed (a recompute line of this CPU's, since session 50): past its two exploration
    reads it may recompute what L3 holds, as the last engine would have, never failing a restore."""
    config = _config(tmp_path / "l3.kv", write_policy=write_policy, policy=policy)
    eng = Engine(config)
    for _ in range(3 if write_policy == "write_through_selective" else 1):  # (it saves at the second hit)
        assert [o.output_ids for o in await _serve(eng)] == reference
    await _end(eng, grace_s=5.0)
    eng = Engine(config)
    assert eng.metrics()["storage_adopted_pages"] >= 27
    outs = await _serve(eng)
    assert [o.output_ids for o in outs] == reference
    from_l3 = [o.cached_tokens.get("l3", 0) >= 32 for o in outs]
    explored = eng.config.hicache.storage_explore_reads
    assert all(from_l3) if policy == "always" else all(from_l3[:explored]), [o.cached_tokens for o in outs]
    assert eng.metrics()["fallbacks"] == 0
    await _end(eng)


@pytest.mark.asyncio
async def test_salted_prefixes_survive_a_restart_still_apart_by_salt(tmp_path, reference):
    config = _config(tmp_path / "l3.kv")
    eng = Engine(config)
    await _serve(eng, PROMPTS[:1], salt="tenant-a")
    await _end(eng)
    eng = Engine(config)
    assert eng.metrics()["storage_adopted_pages"] >= 8
    for salt, hit in (("tenant-b", False), (None, False), ("tenant-a", True)):
        [out] = await _serve(eng, PROMPTS[:1], salt=salt)
        assert out.output_ids == reference[0]
        assert (out.cached_tokens.get("l3", 0) >= 32) is hit, (salt, out.cached_tokens)
    await _end(eng)


@pytest.mark.asyncio
async def test_an_engine_of_another_seed_ignores_the_index(tmp_path):
    """A preset's --seed draws other weights: another model, whose K/V the file's pages are not."""
    config = _config(tmp_path / "l3.kv")
    eng = Engine(config)
    await _serve(eng, PROMPTS[:1])
    await _end(eng)
    eng = Engine(dataclasses.replace(config, seed=1))
    assert eng.metrics()["storage_adopted_pages"] == 0 and not os.path.exists(index_path(str(tmp_path / "l3.kv")))
    [out] = await _serve(eng, PROMPTS[:1])
    assert out.cached_tokens.get("l3", 0) == 0
    await _end(eng)


@pytest.mark.asyncio
async def test_a_restart_while_l3_writes_were_in_flight_adopts_only_what_was_written(tmp_path, reference):
    """Shut down (no grace) while PROMPTS[1]'s L3 write is held: the drain lets it land but publishes
    nothing, so the index lists PROMPTS[0] alone; the next engine is whole and answers both right."""
    config = _config(tmp_path / "l3.kv")
    eng = Engine(config)
    await _serve(eng, PROMPTS[:1])
    await eng.cache.drain()
    gate = WriteGate(eng.cache.store)
    await _serve(eng, PROMPTS[1:2])
    await asyncio.sleep(0.05)
    assert eng.cache.pending_ops() > 0
    threading.Timer(1.0, gate.release).start()  # (well after the shutdown cancelled the op: it waits for the write)
    await eng.shutdown()
    eng = Engine(config)
    assert [eng.cache.tree.match(p, touch=False).lengths[Tier.L3] for p in PROMPTS[:2]] == [32, 0]
    assert_whole(eng.cache)
    assert [o.output_ids for o in await _serve(eng, PROMPTS[:2])] == reference[:2]
    await _end(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("host_pages", [None, 4])
async def test_adopted_prefixes_prefetched_while_queued_or_past_a_full_l2(tmp_path, reference, host_pages):
    """The three prompts queued at once behind one running request: the queued ones prefetch their adopted
    prefixes (L3 -> L2); with an L2 of 4 pages no L3 hit can be staged, and they are recomputed."""
    path = tmp_path / "l3.kv"
    eng = Engine(_config(path))
    await _serve(eng)
    await _end(eng)
    size = {} if host_pages is None else {"host_size_gb": host_pages * eng.cache.geometry.bytes_per_page / 2 ** 30}
    eng = Engine(_config(path, max_running=1, **size))
    outs = await _serve(eng, together=True)
    assert [o.output_ids for o in outs] == reference
    hits = [o.cached_tokens.get("l3", 0) for o in outs]
    assert all(hits) if host_pages is None else not any(hits), hits
    await _end(eng)


def test_a_server_stopped_and_started_on_the_path_answers_from_l3_until_an_operator_resets_it(tmp_path_factory):
    """Three servers in turn on one kept file: the second answers the prompt from L3 (the same text) and
    resets every tier (/reset_prefix_cache, l3 named); the third starts with nothing adopted."""
    from server_fixtures import byte_level_server, ok, tiny_config
    path = tmp_path_factory.mktemp("l3") / "l3.kv"
    config = tiny_config(num_pages=48).with_hicache(enable=True, policy="always", transfer_backend="torch",
                                                    storage_path=str(path), storage_persist=True)
    body = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 4,
            "temperature": 0}
    answers = []
    for run in range(3):
        with byte_level_server(tmp_path_factory, config) as srv:
            adopted = srv.engine.metrics()["storage_adopted_pages"]
            r = ok(srv, "/v1/completions", body)
            answers.append(r["choices"][0]["text"])
            if run == 1:
                assert adopted > 0 and r["usage"]["cached_tokens_per_tier"]["l3"] >= 40
                reset = ok(srv, "/reset_prefix_cache", {"tiers": ["l1", "l2", "l3"]})
                assert reset["pages_left"] == {"l1": 0, "l2": 0, "l3": 0}
            else:
                assert adopted == 0 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            asyncio.run_coroutine_threadsafe(srv.engine.cache.drain(), srv.loop).result(timeout=30)
            srv.call(assert_whole, srv.engine.cache)
    assert answers[0] == answers[1] == answers[2]

"""A file L3 that outlives its engine (--hicache-storage-persist, hicache/l3_index.py): the index saved at a clean
close, adopted by the next manager on the same path, read back byte for byte; an index of another layout, a
smaller file, a damaged page or a damaged index costs pages (a recompute), never a wrong answer or the
tiers' accounting."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.l3_index import index_path
from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, write_prefix
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

A = tuple(range(100, 132))  # 8 pages of 4 tokens
B = A[:16] + tuple(range(500, 516))  # shares A's first 4 pages


def _manager(tmp_path, storage_pages: int = 64, **config):
    config.setdefault("model_id", "m1")
    return make_manager(storage_pages=storage_pages, storage_path=str(tmp_path / "l3.kv"), storage_persist=True,
                        **config)


def _l1_bytes(mgr, tokens) -> torch.Tensor:
    """tokens' K/V as L1 holds them: [layers, 2, pages, ...] (a copy)."""
    pages = mgr.tree.match(tokens, touch=False).pages[Tier.L1]
    return mgr.l1.kv[:, :, pages].clone()


async def _restore_from_l3(mgr, tokens) -> torch.Tensor:
    m = mgr.match(tokens)
    assert m.lengths == [0, 0, len(tokens)]
    op = mgr.runner.start_restore(tokens, m, "l3", "r")
    await mgr.runner.wait_op(op)
    assert op.succeeded
    await mgr.drain()
    return _l1_bytes(mgr, tokens)


async def _saved(tmp_path, *prefixes, **config):
    """A manager that wrote `prefixes` (random K/V) through to L3 and closed cleanly; their L1 bytes."""
    mgr = _manager(tmp_path, **config)
    want = []
    for seed, tokens in enumerate(prefixes):
        write_prefix(mgr, tokens, seed=seed)
        await mgr.drain()
        want.append(_l1_bytes(mgr, tokens))
    assert all(mgr.tree.match(t, touch=False).lengths[Tier.L3] == len(t) for t in prefixes)
    await mgr.close()
    assert os.path.exists(index_path(str(tmp_path / "l3.kv")))
    return want


@pytest.mark.asyncio
async def test_the_next_manager_on_the_file_restores_what_the_last_one_saved(tmp_path):
    """Two prefixes (one shared start): after a clean close and a new manager, L3 alone holds them (L1 and
    L2 start empty), restored byte for byte; the index is consumed as it is read, so a process that dies
    later leaves none to trust."""
    want = await _saved(tmp_path, A, B)
    mgr = _manager(tmp_path)
    assert not os.path.exists(index_path(str(tmp_path / "l3.kv")))
    assert mgr.tree.num_resident_pages == [0, 0, (len(A) + len(B) - 16) // 4]
    assert_whole(mgr)
    assert torch.equal(await _restore_from_l3(mgr, A), want[0])
    mgr.tree.evict(Tier.L1, mgr.l1.num_pages)
    mgr.tree.evict(Tier.L2, mgr.l2.num_pages)
    assert torch.equal(await _restore_from_l3(mgr, B), want[1])
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("used", [None, A])
async def test_the_adopted_prefixes_keep_their_lru_order(tmp_path, used):
    """B written after A; a second run adopts them (and uses A, or nothing) and closes; in the third, L3's
    first eviction takes the least recently used one's own pages: A's, or B's once A was used."""
    await _saved(tmp_path, A, B)
    mgr = _manager(tmp_path)
    if used is not None:
        mgr.match(used)
    await mgr.close()
    mgr = _manager(tmp_path)
    mgr.tree.evict(Tier.L3, 1)
    evicted = [t for t in (A, B) if mgr.tree.match(t, touch=False).lengths[Tier.L3] < len(t)]
    assert evicted == ([B] if used == A else [A])
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_an_index_of_another_model_or_page_layout_is_ignored(tmp_path):
    await _saved(tmp_path, A)
    mgr = _manager(tmp_path, model_id="m2")
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    assert not os.path.exists(index_path(str(tmp_path / "l3.kv")))
    assert_whole(mgr)
    await mgr.close()
    await _saved(tmp_path, A)
    mgr = _manager(tmp_path, dtype=torch.float16)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_smaller_file_keeps_the_nodes_that_fit_and_drops_those_below_one_that_does_not(tmp_path):
    await _saved(tmp_path, A, B)
    mgr = _manager(tmp_path)
    held = {tuple(n.key): list(n.pages[Tier.L3]) for n in mgr.tree.iter_nodes() if n.pages[Tier.L3]}
    await mgr.close()
    top = max(s for pages in held.values() for s in pages)
    mgr = _manager(tmp_path, storage_pages=top)  # the highest slot is past the end now
    kept = {tuple(n.key) for n in mgr.tree.iter_nodes() if n.pages[Tier.L3]}
    assert kept and kept < set(held)
    assert all(max(held[k]) < top for k in kept)
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_page_changed_between_runs_fails_its_checksum_and_is_dropped(tmp_path):
    """The file written over between runs: the adopted page's read fails verification, the restore fails
    (its request would recompute) and the page leaves L3; nothing is read wrong."""
    await _saved(tmp_path, A)
    mgr = _manager(tmp_path)
    first_slot = mgr.tree.match(A, touch=False).pages[Tier.L3][0]
    with open(tmp_path / "l3.kv", "r+b") as f:
        f.seek(mgr.store.offset(first_slot))
        f.write(b"\xff" * 64)
    m = mgr.match(A)
    op = mgr.runner.start_restore(A, m, "l3", "r")
    await mgr.runner.wait_op(op)
    assert not op.succeeded
    await mgr.drain()
    assert mgr.tree.match(A, touch=False).lengths[Tier.L3] == 0
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", ["garbage", "slots_twice", "parent_after_child", "float_tokens", "own_parent",
                                    "negative_slot"])
async def test_a_damaged_index_is_ignored(tmp_path, damage):
    """An index that is not one, or names a slot twice, a parent after its child or itself, a negative slot, float
    tokens: ignored, the engine starts with an empty, whole L3 (not a start that fails, nor pages adopted at a slot
    that does not exist; own_parent and negative_slot: session 56's mutation check)."""
    await _saved(tmp_path, A, B)
    path = index_path(str(tmp_path / "l3.kv"))
    if damage == "garbage":
        with open(path, "r+b") as f:
            f.write(b"not a zip file")
    else:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        if damage == "slots_twice":
            arrays["slots"][1] = arrays["slots"][0]
        elif damage == "float_tokens":  # (tokens 1.0 and 1 match in a tuple: an index of floats is no index)
            arrays["tokens"] = arrays["tokens"].astype(np.float64)
        elif damage == "own_parent":
            arrays["parents"][0] = 0
        elif damage == "negative_slot":
            arrays["slots"][0] = -1
        else:
            arrays["parents"][0] = len(arrays["parents"]) - 1
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    mgr = _manager(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    assert not os.path.exists(path)
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_without_the_flag_nothing_is_saved_and_the_file_starts_empty(tmp_path):
    mgr = make_manager(storage_path=str(tmp_path / "l3.kv"))
    write_prefix(mgr, A)
    await mgr.drain()
    await mgr.close()
    assert not os.path.exists(index_path(str(tmp_path / "l3.kv")))
    assert os.path.getsize(tmp_path / "l3.kv") > 0
    mgr = make_manager(storage_path=str(tmp_path / "l3.kv"))
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    await mgr.close()


@pytest.mark.parametrize("fields, says", [
    ({}, "--hicache-storage-path"),
    ({"storage_path": "/tmp/x.kv", "storage_checksum": False}, "checksums"),
    ({"storage_backend": "redis", "storage_url": "redis://localhost:6379/0"}, "--hicache-storage-path"),
])
def test_persistence_needs_a_path_the_file_backend_and_checksums(fields, says):
    with pytest.raises(ValueError, match=says):
        HiCacheConfig(enable=True, storage_persist=True, **fields)


@pytest.mark.asyncio
async def test_a_restarted_engine_answers_from_the_l3_its_predecessor_left(tmp_path):
    """End to end (tiny preset, --hicache-policy always): the same prompt after a restart is an L3 hit with
    the same greedy output."""
    prompt = [(7 * i + 3) % 200 + 5 for i in range(33)]
    config = EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=4).with_hicache(
        enable=True, policy="always", transfer_backend="torch", storage_path=str(tmp_path / "l3.kv"),
        storage_persist=True)
    eng = Engine(config)
    first = (await eng.generate_async([prompt], SamplingParams(max_tokens=4)))[0]
    await eng.cache.drain()
    await eng.shutdown()
    eng = Engine(config)
    assert eng.cache.tree.match(prompt, touch=False).lengths[Tier.L3] == 32
    adopted = eng.cache.tree.num_resident_pages[Tier.L3]  # (the prompt's 8 pages, and its answer's)
    again = (await eng.generate_async([prompt], SamplingParams(max_tokens=4)))[0]
    assert again.output_ids == first.output_ids
    assert again.cached_tokens.get("l3", 0) > 0
    assert eng.metrics()["storage_adopted_pages"] == adopted >= 8  # exported too:
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler.prom import ServerMetrics
    [fam] = [f for f in text_string_to_metric_families(ServerMetrics(eng).render().decode())
             if f.name == "hicache_storage_adopted_pages"]
    assert [s.value for s in fam.samples if s.name.endswith("_total")] == [adopted]
    eng.cache.check_integrity()
    await eng.shutdown()


@pytest.mark.asyncio
async def test_write_back_saves_its_unsaved_prefixes_for_the_next_engine_within_the_shutdown_grace(tmp_path):
    """Under write_back L1 keeps a prefix until it leaves; a shutdown with a grace backs it up (as for a shared
    Redis L3), so the next engine on the persisted file has it (without the flag a file L3 goes with its
    process, and nothing is saved)."""
    prompt = [(5 * i + 1) % 200 + 5 for i in range(33)]
    config = EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=4).with_hicache(
        enable=True, policy="always", transfer_backend="torch", write_policy="write_back",
        storage_path=str(tmp_path / "l3.kv"), storage_persist=True)
    eng = Engine(config)
    await eng.generate_async([prompt], SamplingParams(max_tokens=2))
    assert eng.cache.tree.match(prompt, touch=False).lengths[Tier.L3] == 0
    await eng.shutdown(grace_s=5.0)
    eng = Engine(config)
    assert eng.cache.tree.match(prompt, touch=False).lengths[Tier.L3] == 32
    eng.cache.check_integrity()
    await eng.shutdown()


def test_the_flag_reaches_the_config():
    import argparse

    from scheduler.config import add_engine_args, config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--enable-hicache", "--hicache-storage-path", "/tmp/l3.kv", "--hicache-storage-persist"])
    assert config_from_args(args).hicache.storage_persist is True
    assert config_from_args(parser.parse_args([])).hicache.storage_persist is False


def test_taking_pages_that_are_not_free_takes_nothing():
    from hicache.allocator import AllocatorError, PageAllocator
    alloc = PageAllocator(16, "l3")
    mine, other = alloc.new_claim("index"), alloc.new_claim("other")
    alloc.alloc(2, other)  # pages 0, 1
    with pytest.raises(AllocatorError, match="not free"):
        alloc.take([1, 5], mine)
    alloc.take([5, 7, 6, 12], mine)
    assert alloc.pages_of(mine) == [5, 6, 7, 12] and alloc.num_free == 10
    assert alloc.alloc(4, other) == [8, 9, 10, 11]  # (the free runs rebuilt: 2-4, 8-11, 13-15; best fit)
    alloc.check([])


@pytest.mark.asyncio
async def test_the_index_is_neither_written_nor_read_through_a_symbolic_link(tmp_path):
    """A link left at the index's paths (another user's, say) is not followed: the save removes a link at its
    temporary name and writes a file of its own (session 53: whatever lies there goes first, as a FIFO blocked the
    save), the file the link names untouched; a linked index is not adopted."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    os.symlink(victim, index_path(str(tmp_path / "l3.kv")) + ".tmp")
    mgr = _manager(tmp_path)
    write_prefix(mgr, A)
    await mgr.drain()
    await mgr.close()
    assert victim.read_bytes() == b"keep me" and not os.path.islink(index_path(str(tmp_path / "l3.kv")))
    await _saved(tmp_path, A)
    os.rename(index_path(str(tmp_path / "l3.kv")), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", index_path(str(tmp_path / "l3.kv")))
    mgr = _manager(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    await mgr.close()


def test_a_replay_run_twice_on_a_kept_file_starts_from_the_first_run_s_l3(tmp_path):
    """The replay driver with the flag: its second run adopts what the first left (the summary says how much) and
    serves hits from L3 from its first requests, outputs equal to the first run's."""
    import structlog

    from scheduler.replay import format_summary, run_cli
    args = ["--max-requests", "12", "--time-scale", "0", "--concurrency", "1", "--max-input-tokens", "256",
            "--max-output-tokens", "4", "--block-tokens", "16", "--hicache-policy", "always", "--no-progress",
            "--hicache-storage-path", str(tmp_path / "l3.kv"), "--hicache-storage-persist"]
    saved = structlog.get_config()
    try:
        first, second = run_cli(args), run_cli(args)
    finally:
        structlog.configure(**saved)
    assert first["metrics"]["storage_adopted_pages"] == 0 < second["metrics"]["storage_adopted_pages"]
    assert second["hit_tokens"]["l3"] > first["hit_tokens"]["l3"]
    assert second["outputs_digest"] == first["outputs_digest"]
    assert first["integrity"] == second["integrity"] == "passed"
    assert "L3 adopted at start" in format_summary(second) and "L3 adopted" not in format_summary(first)


def test_a_write_back_replay_saves_its_prefixes_for_the_next_run(tmp_path):
    """(regression: the replay shut its engine down without a grace, so under write_back the prefixes only L1 held
    were never saved, and the next run on the kept file adopted nothing)"""
    import structlog

    from scheduler.replay import run_cli
    args = ["--max-requests", "12", "--time-scale", "0", "--concurrency", "1", "--max-input-tokens", "256",
            "--max-output-tokens", "4", "--block-tokens", "16", "--hicache-policy", "always", "--no-progress",
            "--hicache-write-policy", "write_back", "--hicache-storage-path", str(tmp_path / "l3.kv"),
            "--hicache-storage-persist"]
    saved = structlog.get_config()
    try:
        first, second = run_cli(args), run_cli(args)
    finally:
        structlog.configure(**saved)
    assert second["metrics"]["storage_adopted_pages"] > 0 and second["hit_tokens"]["l3"] > 0
    assert second["outputs_digest"] == first["outputs_digest"] and second["integrity"] == "passed"


def test_a_simulated_replay_says_the_flag_keeps_nothing(capsys, tmp_path):
    from scheduler.replay import build_parser
    from scheduler.replay_args import config_from_replay_args, fill_defaults
    args = build_parser().parse_args(["--simulate", "--hicache-storage-path", str(tmp_path / "l3.kv"),
                                      "--hicache-storage-persist"])
    fill_defaults(args)
    assert config_from_replay_args(args).simulate
    assert "--hicache-storage-persist keeps nothing" in capsys.readouterr().err


# -- the cost model's samples, kept with the index ------------------------------------------------------------
def _timed(mgr) -> None:
    """Samples of two directions no backup times: an L3 read line and a recompute line, several sizes each."""
    for pages in (1, 4, 16, 64):
        mgr.cost.observe_transfer("s2h", pages * 4096, 2e-4 + pages * 3e-5)
    for tokens in (16, 64, 256, 1024):
        mgr.cost.observe_prefill(tokens, 2e-3 + tokens * 3e-5)


@pytest.mark.asyncio
async def test_the_next_manager_on_this_machine_prices_as_the_last_one_did(tmp_path):
    """The L3 read and recompute lines the closed manager learned are the next one's from its start (not the
    priors): the same samples, the same fit."""
    mgr = _manager(tmp_path)
    write_prefix(mgr, A, seed=0)
    await mgr.drain()
    _timed(mgr)
    want = {d: (mgr.cost.directions[d].samples(), mgr.cost.directions[d].state()) for d in ("s2h", "recompute")}
    assert all(state["regime"] != "prior" for _, state in want.values())
    await mgr.close()
    nxt = _manager(tmp_path)
    assert nxt.metrics.storage_adopted_pages == len(A) // 4
    assert {d: (nxt.cost.directions[d].samples(), nxt.cost.directions[d].state()) for d in want} == want
    assert_whole(nxt)
    await nxt.close()


@pytest.mark.asyncio
async def test_cost_samples_of_another_machine_or_malformed_ones_leave_the_priors(tmp_path, monkeypatch):
    from structlog.testing import capture_logs

    from hicache import l3_index
    for case in ("machine", "malformed"):
        mgr = _manager(tmp_path)
        write_prefix(mgr, A, seed=0)
        await mgr.drain()
        _timed(mgr)
        with monkeypatch.context() as m:
            if case == "machine":
                m.setattr(l3_index, "_machine", lambda mgr: {"host": "elsewhere", "device": "cpu"})
            else:
                m.setattr(mgr.cost, "samples", lambda: {"s2h": [[4096, "slow"]], "recompute": [[16, 1e-3]]})
            await mgr.close()
        with capture_logs() as logs:
            nxt = _manager(tmp_path)
        assert nxt.metrics.storage_adopted_pages == len(A) // 4  # (the pages are adopted either way)
        assert nxt.cost.directions["s2h"].regime == nxt.cost.directions["recompute"].regime == "prior"
        assert any(e["event"] == "l3_index_costs_ignored" for e in logs) == (case == "malformed")
        await nxt.close()


def test_learn_again_checks_every_sample_first_and_keeps_a_window():
    from hicache.linear_cost import WINDOW_SAMPLES
    mgr = make_manager(storage_pages=0)
    for bad in ({"nowhere": [[1, 1]]}, {"s2h": [[1, -1.0]]}, {"s2h": [[1, float("nan")]]}, {"s2h": [[True, 1]]},
                {"s2h": [[1, 2, 3]]}, {"s2h": "1,1"}, {"h2d": [[1, 1e-3]], "s2h": [[1]]},
                # (regressions: OverflowError stopped the engine's start, or priced L3 out for thousands of reads)
                {"recompute": [[10 ** 400, 1e-3]]}, {"recompute": [[1e300, 1e-3], [1e200, 2e-3]]},
                {"s2h": [[4096, 1e300]]}, {"s2h": [[4096, float("inf")]]}):
        with pytest.raises(ValueError):
            mgr.cost.learn_again(bad)
        assert all(c.regime == "prior" for c in mgr.cost.directions.values())  # (nothing learned)
    rows = [[16 * (i % 5 + 1), 1e-3 * (i % 5 + 1)] for i in range(WINDOW_SAMPLES + 8)]
    assert mgr.cost.learn_again({"recompute": rows}) == WINDOW_SAMPLES
    assert mgr.cost.directions["recompute"].samples() == [tuple(map(float, r)) for r in rows[-WINDOW_SAMPLES:]]


@pytest.mark.asyncio
@pytest.mark.parametrize("edit", ["huge_integer", "huge_size", "list", "string"])
async def test_an_index_header_edited_into_nonsense_starts_the_engine(tmp_path, edit):
    """A kept index whose header is valid JSON but nonsense (a sample past a float's range or whose fit overflows,
    a header that is no object) raised from the manager's start (OverflowError, AttributeError): the next engine
    never came up. Now the samples are ignored (the pages adopted) or the index is (nothing adopted), with a
    warning, and the tiers are whole."""
    import json

    import numpy as np
    from structlog.testing import capture_logs

    from hicache.l3_index import index_path
    mgr = _manager(tmp_path)
    write_prefix(mgr, A, seed=0)
    await mgr.drain()
    _timed(mgr)
    await mgr.close()
    path = index_path(str(tmp_path / "l3.kv"))
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(str(arrays.pop("header")))
    if edit == "huge_integer":
        header["cost_samples"]["recompute"] = [[10 ** 400, 1e-3]]
    elif edit == "huge_size":
        header["cost_samples"]["recompute"] = [[1e300, 1e-3], [1e200, 2e-3]]
    with open(path, "wb") as f:
        np.savez(f, header=np.array(json.dumps({"list": [header], "string": "header"}.get(edit, header))), **arrays)
    with capture_logs() as logs:
        nxt = _manager(tmp_path)
    events = {e["event"] for e in logs}
    if edit in ("list", "string"):
        assert "l3_index_ignored" in events and nxt.metrics.storage_adopted_pages == 0
    else:
        assert "l3_index_costs_ignored" in events and nxt.metrics.storage_adopted_pages == len(A) // 4
        assert nxt.cost.directions["recompute"].regime == "prior"
    assert_whole(nxt)
    await nxt.close()

"""Rules of the per-request cost policy (hicache/cost_policy.py) and of the kept L3 file's index (hicache/l3_index.py)
that session 64's mutation check of both found no test watching. Cost lines are set by hand and indexes edited by
hand, so every outcome asserted here is deterministic."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hicache import l3_index
from hicache.config import HiCacheConfig
from hicache.geometry import KVGeometry
from hicache.l3_index import index_path
from hicache.manager import CacheManager
from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, write_prefix

N = 100  # tokens a write or a hit carries in the cost tests


def _set_lines(cost, *, recompute_us: float, h2d_us: float, s2h_us: float = 0.0, d2h_us: float = 0.0) -> None:
    """Cost lines with no fixed cost, each given in microseconds per token."""
    per_byte = 1e-6 / cost.bytes_per_token
    for name, us in (("h2d", h2d_us), ("s2h", s2h_us), ("d2h", d2h_us)):
        cost.directions[name].fixed_s, cost.directions[name].slope = 0.0, us * per_byte
    cost.directions["recompute"].fixed_s, cost.directions["recompute"].slope = 0.0, recompute_us * 1e-6


# ---- whole_first_pages -------------------------------------------------------------------------------------------
def test_no_page_goes_whole_first_before_an_h2d_was_timed_or_where_it_was_timed_at_nothing():
    """The prior host bandwidth says a 100-page restore takes far longer than a 1 ns forward, but until an H2D was
    timed the split is not trusted: all in layers (0). An H2D line timed at 0 s (a copy too short to see) prices
    the restore at nothing: all in layers too, not a division by zero in the restore's start."""
    mgr = make_manager(policy="cost")
    mgr.overlap_forward_s = 1e-9
    assert mgr.cost.directions["h2d"].predict(100 * mgr.geometry.bytes_per_page) > 0
    assert mgr.whole_first_pages(100) == 0, "pages went whole first on the prior's H2D estimate"
    for pages in (4, 8):
        mgr.cost.observe_transfer("h2d", pages * mgr.geometry.bytes_per_page, 0.0)
    assert mgr.cost.directions["h2d"].predict(100 * mgr.geometry.bytes_per_page) == 0
    assert mgr.whole_first_pages(100) == 0


# ---- decide ------------------------------------------------------------------------------------------------------
def test_a_decision_counts_the_forwards_a_restore_saves():
    """A 3,000-token L2 hit of a 5,000-token prompt, 2,048 tokens a forward: recomputed, 3 forwards; restored, 1.
    The two forwards saved are priced at the recompute line's fixed cost each (prompt and chunk both reach the
    cost model)."""
    mgr = make_manager(policy="cost", host_explore_transfers=0, storage_explore_reads=0, restore_explore_every=0)
    _set_lines(mgr.cost, recompute_us=1.0, h2d_us=0.1)
    mgr.cost.directions["recompute"].fixed_s = 1e-3
    d = mgr.decide(SimpleNamespace(lengths=[0, 3000, 0]), prompt_tokens=5000, chunk_tokens=2048)
    assert d.costs.get("l2_recompute_forwards_s") == pytest.approx(2e-3), d.costs


def test_a_forced_never_policy_counts_no_declined_restore():
    """--hicache-policy never recomputes every hit by configuration: no hit it does not restore is a policy skip (the
    declined-restore metric stays 0)."""
    mgr = make_manager(policy="never")
    match = SimpleNamespace(lengths=[0, 64, 64])
    d = mgr.decide(match)
    assert d.tier == "l1" and not mgr.declines_restore(match, d)
    assert mgr.metrics.policy_skips["restore"] == 0


# ---- write admission ---------------------------------------------------------------------------------------------
def test_a_forced_always_policy_backs_up_what_the_cost_model_would_refuse():
    """--hicache-policy always writes every backup: a one-token extension whose D2H costs more than the recompute a
    read of it saves, which the cost policy refuses, is backed up."""
    for policy, want in (("cost", False), ("always", True)):
        mgr = make_manager(policy=policy, storage_pages=0, host_explore_transfers=0, restore_explore_every=0)
        _set_lines(mgr.cost, recompute_us=50.0, h2d_us=3.0, d2h_us=3.0)
        mgr.cost.directions["d2h"].fixed_s = 1.5e-3
        assert mgr.backup_worth_its_cost(1) == want, policy


def test_backup_checks_spend_none_of_l3s_exploration_writes():
    """While no storage read was timed, the first 32 L3 writes go ahead of their price, and so do the L2 backups
    they go through (backup_worth_its_cost). Asking whether a backup is worth its cost writes nothing to L3: after
    40 asks every one was let through and the next real L3 write still explores."""
    mgr = make_manager(policy="cost", host_explore_transfers=0, restore_explore_every=0)
    _set_lines(mgr.cost, recompute_us=50.0, h2d_us=3.0, s2h_us=100.0, d2h_us=3.0)
    mgr.cost.directions["d2h"].fixed_s = 1.5e-3
    assert mgr.cost.exploring_storage and not mgr.cost.backup_worth_its_cost(1)
    assert all(mgr.backup_worth_its_cost(1) for _ in range(40)), "the backup checks used up L3's exploration"
    assert mgr.worth_writing("l3", N)


def test_a_backup_feeding_a_productive_l3_worth_writing_under_load_pays_off():
    """An L3 restore (3 us a token) dearer than its recompute (1 us) alone is worth writing beside 1 ms of queued GPU
    work; L3 is read back (productive), L2 is not: every backup that feeds such an L3 write pays off under load, not
    only the L2 reuse gate's probes."""
    mgr = make_manager(policy="cost", host_explore_transfers=0, storage_explore_reads=0, restore_explore_every=0)
    _set_lines(mgr.cost, recompute_us=1.0, h2d_us=0.1, s2h_us=3.0)
    mgr.reuse[Tier.L2].on_evicted(1000)
    assert mgr.reuse[Tier.L3].productive and not mgr.reuse[Tier.L2].productive
    assert [mgr.backup_pays_off(N) for _ in range(8)].count(True) <= 1  # idle: the L2 gate's probes only
    mgr.busy_s = 1e-3
    assert all(mgr.backup_pays_off(N) for _ in range(8)), "the queued GPU work was not credited to the L3 write"


# ---- learning ----------------------------------------------------------------------------------------------------
def test_a_forward_over_no_token_teaches_the_recompute_line_nothing():
    mgr = make_manager(policy="cost")
    mgr.observe_prefill(0, 0.5)
    line = mgr.cost.directions["recompute"]
    assert line.num_samples == 0 and line.fixed_s == 0.0 and line.regime == "prior"


def _no_l2_manager() -> CacheManager:
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    return CacheManager(geometry, 16, "cpu", HiCacheConfig(enable=False, policy="cost", transfer_backend="torch"))


@pytest.mark.parametrize("make", [lambda: make_manager(policy="always"), lambda: make_manager(policy="never"),
                                  _no_l2_manager], ids=["always", "never", "no_l2"])
def test_outcomes_are_learned_only_where_the_cost_policy_prices_restores(make):
    """A request's end-to-end outcome charges its prefix source only in the cost policy's prices: under a forced
    policy, or without an L2 to restore from, nothing is learned (the status' cost_model.outcomes stay empty)."""
    mgr = make()
    before = mgr.cost.outcomes.state()
    for _ in range(8):
        mgr.observe_outcome("l1", ((), 16), 1.0)
    assert mgr.cost.outcomes.state() == before
    live = make_manager(policy="cost")
    for _ in range(8):
        live.observe_outcome("l1", ((), 16), 1.0)
    assert live.cost.outcomes.residual_s("l1") is not None  # (the cost policy with L2 learns it)


# ---- the L3 index ------------------------------------------------------------------------------------------------
A = tuple(range(100, 132))  # 8 pages of 4 tokens
B = A[:16] + tuple(range(500, 516))  # shares A's first 4 pages


def _manager(tmp_path, storage_pages: int = 64, **config):
    config.setdefault("model_id", "m1")
    return make_manager(l1_pages=64, host_pages=64, storage_pages=storage_pages, storage_path=str(tmp_path / "l3.kv"),
                        storage_persist=True, **config)


async def _saved(tmp_path, *prefixes) -> None:
    mgr = _manager(tmp_path)
    for seed, tokens in enumerate(prefixes):
        write_prefix(mgr, tokens, seed=seed)
        await mgr.drain()
    await mgr.close()


def _edit(tmp_path, change) -> None:
    """Rewrite the saved index with `change(arrays, header)` applied."""
    path = index_path(str(tmp_path / "l3.kv"))
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(str(arrays.pop("header")))
    change(arrays, header)
    with open(path, "wb") as f:
        np.savez(f, header=np.array(json.dumps(header)), **arrays)


def _last_node_gone(*arrays: str):
    """The last node's tokens, slots and checksums gone, and its entry in each of `arrays`."""
    def change(a, h):
        k = int(a["key_tokens"][-1])
        a["tokens"], a["slots"], a["checksums"] = a["tokens"][:-k], a["slots"][:-k // 4], a["checksums"][:-k // 4]
        for name in arrays:
            a[name] = a[name][:-1]
        if "key_tokens" not in arrays:
            a["key_tokens"][-1] = 0
    return change


def _misaligned(a, h):  # two tokens moved from the last node to the one before: lengths add up, pages do not
    a["key_tokens"][-2] += 2
    a["key_tokens"][-1] -= 2


DAMAGE = {
    "format": lambda a, h: h.update(format="hicache-l3-index-v3"),
    "short_lru_ranks": lambda a, h: a.update(lru_ranks=a["lru_ranks"][:-1]),
    "short_key_tokens": _last_node_gone("key_tokens"),
    "zero_length_node": _last_node_gone(),
    "misaligned_node": _misaligned,
    "tokens_short": lambda a, h: a.update(tokens=a["tokens"][:-4], slots=a["slots"][:-1],
                                          checksums=a["checksums"][:-1]),
    "slots_short": lambda a, h: a.update(slots=a["slots"][:-1], checksums=a["checksums"][:-1]),
    "checksums_short": lambda a, h: a.update(checksums=a["checksums"][:-1]),
    "parent_below_the_root": lambda a, h: a["parents"].__setitem__(len(a["parents"]) - 1, -2),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", list(DAMAGE))
async def test_an_index_that_does_not_add_up_is_ignored(tmp_path, damage):
    """An index of another format, or whose arrays disagree on the nodes, a node's length, its slots or its parent
    (one below the root would be adopted at the root, its K/V under the wrong prefix): ignored, the engine starts
    with an empty, whole L3."""
    await _saved(tmp_path, A, B)
    _edit(tmp_path, DAMAGE[damage])
    mgr = _manager(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    assert not os.path.exists(index_path(str(tmp_path / "l3.kv")))
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_a_node_listed_twice_is_adopted_once_and_its_second_slots_go_back(tmp_path):
    """An index naming A's path twice (at other slots the second time): A is adopted once; the second entry's slots
    go back free, neither held by the start's claim (which failed the start) nor readable in the store."""
    await _saved(tmp_path, A)

    def twice(a, h):
        k, pages = int(a["key_tokens"][0]), int(a["key_tokens"][0]) // 4
        for name, extra in (("parents", [-1]), ("key_tokens", [k]), ("tokens", a["tokens"][:k]),
                            ("slots", np.arange(40, 40 + pages)), ("checksums", a["checksums"][:pages]),
                            ("lru_ranks", [len(a["lru_ranks"])])):
            a[name] = np.concatenate([a[name], np.asarray(extra, dtype=a[name].dtype)])
    _edit(tmp_path, twice)
    mgr = _manager(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == len(A) // 4
    assert not any(mgr.store.exists(list(range(40, 40 + len(A) // 4))))
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_nodes_past_a_smaller_file_are_dropped_and_the_next_ones_keep_their_own_tokens(tmp_path):
    """Root children C and P at slots 8-15 (saved first), then A at 0-3 and P's child Q at 4-7; a restart on an
    8-slot file drops C, P and Q below P (though Q's slots fit: a start that raised TypeError), and adopts A
    under A's own tokens (C's, read in C's place, would have served A's K/V to a prompt starting with C)."""
    X, C, P = tuple(range(1000, 1032)), tuple(range(2000, 2016)), tuple(range(3000, 3016))
    Q = P + tuple(range(4000, 4016))
    mgr = _manager(tmp_path)
    for seed, tokens in enumerate((X, C, P)):
        write_prefix(mgr, tokens, seed=seed)
        await mgr.drain()
    mgr.tree.evict(Tier.L3, len(X) // 4)  # X, the oldest: slots 0-7 free again
    for seed, tokens in enumerate((A[:16], Q)):
        write_prefix(mgr, tokens, seed=seed)
        await mgr.drain()
    slots = {t: mgr.tree.match(t, touch=False).pages[Tier.L3] for t in (C, P, A[:16], Q)}
    assert max(slots[A[:16]] + slots[Q][4:]) < 8 <= min(slots[C] + slots[P]), slots
    await mgr.close()
    mgr = _manager(tmp_path, storage_pages=8)
    assert [mgr.tree.match(t, touch=False).lengths[Tier.L3] for t in (C, P, A[:16], Q)] == [0, 0, 16, 0]
    assert mgr.tree.num_resident_pages[Tier.L3] == 4
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("field", ["cost_samples", "cost_references"])
async def test_cost_samples_or_references_that_are_no_object_leave_the_priors_and_the_pages(tmp_path, field):
    await _saved(tmp_path, A)
    _edit(tmp_path, lambda a, h: h.update({field: [[16, 1e-3]]}))
    mgr = _manager(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == len(A) // 4  # (a start that raised AttributeError before)
    if field == "cost_samples":
        assert all(d.regime == "prior" for d in mgr.cost.directions.values())
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_cost_samples_of_another_device_on_the_same_host_are_not_learned(tmp_path):
    """The same host with another accelerator (a GPU swapped, or a CPU run's samples on a GPU run): the samples were
    timed on other hardware and leave the priors."""
    mgr = _manager(tmp_path)
    write_prefix(mgr, A)
    await mgr.drain()
    for tokens in (16, 64, 256, 1024):
        mgr.cost.observe_prefill(tokens, 2e-3 + tokens * 3e-5)
    await mgr.close()
    _edit(tmp_path, lambda a, h: h["machine"].update(device="NVIDIA H100 80GB HBM3"))
    mgr = _manager(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == len(A) // 4
    assert mgr.cost.directions["recompute"].regime == "prior"
    await mgr.close()


@pytest.mark.asyncio
async def test_a_save_neither_writes_through_a_link_it_cannot_remove_nor_leaves_its_temporary_file(tmp_path,
                                                                                                   monkeypatch):
    """A link at the save's temporary name that cannot be removed (another user's, in a sticky directory) is not
    written through: the save fails, the file the link names keeps its bytes. A save that fails after writing its
    temporary file (the rename) removes it. The L3 file is fsynced before its index is written."""
    tmp = index_path(str(tmp_path / "l3.kv")) + ".tmp"
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if str(path) == tmp and os.path.islink(tmp):
            raise PermissionError(1, "Operation not permitted")
        return real_unlink(path, *args, **kwargs)

    mgr = _manager(tmp_path)
    write_prefix(mgr, A)
    await mgr.drain()
    os.symlink(victim, tmp)  # (once the store opened: its start removes what lies at the temporary name, session 75)
    with monkeypatch.context() as m:
        m.setattr(os, "unlink", unlink)
        assert l3_index.save(mgr) == 0
    assert victim.read_bytes() == b"keep me"
    real_unlink(tmp)
    calls = []
    monkeypatch.setattr(mgr.store, "sync", lambda real=mgr.store.sync: (calls.append(os.path.exists(tmp)), real()))
    with monkeypatch.context() as m:
        m.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        assert l3_index.save(mgr) == 0
    assert not os.path.lexists(tmp) and not os.path.lexists(index_path(str(tmp_path / "l3.kv")))
    assert calls == [False], "the L3 file was not fsynced before its index was written"
    await mgr.close()


@pytest.mark.asyncio
async def test_a_run_without_the_flag_removes_a_dangling_link_at_the_index(tmp_path):
    """A link at the index's name whose target is gone is still an entry there: a run without the flag on the path
    removes it with the rest of what describes bytes the truncation lost."""
    path = index_path(str(tmp_path / "l3.kv"))
    os.symlink(tmp_path / "gone", path)
    mgr = make_manager(storage_path=str(tmp_path / "l3.kv"))
    assert not os.path.lexists(path)
    await mgr.close()

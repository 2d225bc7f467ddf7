"""A corrupt prefix dropped as suspect while a restore or prefetch copies it fails no second request
(a bug hunt).

`Admission._fail_nan` drops a prefix whose reuse gave NaN logits from every tier but where it is
locked (hicache/suspect.py); backups locking it are stopped (tests/test_nan_backup_hunt.py). A
restore (L2 -> L1) or an L3 prefetch (L3 -> L2) of the pages below it locks it too: its L1 head,
its L2 or L3 source. Regression: that op went on, published its copy (computed on top of the
corrupt head, NaN), its locked head stayed once it let go, and the request waiting for it (parked
on it, or admitted with its forward running behind the copy) ran on the corrupt K/V and failed as
well. Now the op stops at its next step without publishing, its private L1 pages go back zeroed,
its request recomputes the prefix (the usual restore-fault fallback), and the prefix is dropped
again in the tiers the op held once it ended (and once that request's lock on the head went).

Request B (PROMPT: HEAD then 2 pages) restores its 2 pages past HEAD from L2, or prefetches them
from L3, while request A (HEAD then other tokens) reuses HEAD from L1 and fails. Every copy is NaN
(the L3 one with valid checksums: a NaN page backed up passes them). CPU, tiny preset; B's copy is
held in flight by a gate (tests/test_faults.py)."""
from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from hicache.faults import FaultInjector
from hicache.ops import OpKind, OpState
from hicache.radix import Tier
from hicache.suspect import drop_suspect_prefix
from hicache_helpers import ReadGate, assert_whole, finish, make_manager, read_stream, until, write_prefix
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from test_faults import OTHER, PAGE, PARAMS, PROMPT, REUSABLE, TransferGate, reference, run_one

TOKENS = tuple(PROMPT[:REUSABLE])  # B's prefix: 6 pages
HEAD = 4 * PAGE  # what A reuses (from L1): B's op locks it
A_PROMPT = list(PROMPT[:HEAD]) + list(OTHER[:3])

# how B gets its pages past HEAD -> (source, B's forward runs behind the copy, the op's held state):
# an L2 restore landing layer by layer under its forward, an L2 restore it is parked on, an L3
# prefetch it is parked on, an L3 prefetch it took on to L1 while the read's checksums run
CASES = {"l2_overlapped": ("l2", True, OpState.H2D_PENDING), "l2_parked": ("l2", False, OpState.H2D_PENDING),
         "l3_prefetch": ("l3", False, OpState.S2H_PENDING), "l3_taken_on": ("l3", True, OpState.H2D_VERIFYING)}


def _engine(restore_overlap: bool) -> Engine:
    config = EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=PAGE,
                          restore_overlap=restore_overlap).with_hicache(enable=True, transfer_backend="torch",
                                                                        policy="always")
    return Engine(config, faults=FaultInjector())


def _lengths(eng) -> list[int]:
    return eng.cache.tree.match(TOKENS, touch=False).lengths


def _drop_past_head(eng, tier: Tier) -> None:
    """`tier` loses B's pages past HEAD (and the answer's page below them)."""
    tree = eng.cache.tree
    head = tree.match(TOKENS[:HEAD], touch=False)  # (splits the prompt's node at HEAD)
    pages = tree.drop(tree.match(TOKENS, touch=False).path[len(head.path)], tier)
    if tier is Tier.L1:  # (the free pool holds finite values)
        eng.cache.l1.kv[:, :, torch.tensor(pages, dtype=torch.int64)] = 0


async def _corrupt_then_below_l1(eng, source: str) -> None:
    """PROMPT cached, then its prefix's K/V NaN in every tier: its L1 pages turn NaN and are backed
    up again (L2 and L3 copies dropped first: the L3 pages' checksums are the NaN bytes'). Then
    B's pages past HEAD leave L1 (and L2, with source "l3"): B's op copies them from `source`."""
    cache, tree = eng.cache, eng.cache.tree
    assert (await run_one(eng)).error is None
    await cache.drain()
    tree.evict(Tier.L2, cache.l2.num_pages)
    tree.evict(Tier.L3, cache.store.num_slots)
    assert _lengths(eng) == [REUSABLE, 0, 0]
    l1_pages = tree.match(TOKENS, include_storage=False, touch=False).pages[Tier.L1]
    cache.l1.kv[:, :, torch.tensor(l1_pages, dtype=torch.int64)] = float("nan")
    cache.back_up_l1(TOKENS)
    await cache.drain()
    assert _lengths(eng) == [REUSABLE] * 3
    _drop_past_head(eng, Tier.L1)
    if source == "l3":
        _drop_past_head(eng, Tier.L2)
    assert _lengths(eng) == ([HEAD, REUSABLE, REUSABLE] if source == "l2" else [HEAD, HEAD, REUSABLE])


def _hold(eng, source: str, overlap: bool) -> Callable[[], None]:
    """Hold B's copy in flight; returns its release. An L2 restore's H2D (its completion); an L3
    read (its completion), or, for a prefetch its request takes on, the read's checksums (in their
    verify threads: its bytes land, the take-on's H2D and forward run, then it waits)."""
    store = eng.cache.store
    if source == "l2":
        gate = TransferGate(eng, "h2d")
        return gate.release.set
    if not overlap:
        return ReadGate(store).release
    checked, verify = threading.Event(), store._verify

    def held(*args):
        checked.wait(30)
        return verify(*args)
    store._verify = held
    return checked.set


def _tree_pages_finite(eng) -> None:
    """No page the tree holds in L1 or L2 holds NaN, nor any free L1 page."""
    mgr = eng.cache
    assert not torch.isnan(mgr.l1.kv).any()
    for node in mgr.tree.iter_nodes():
        if node is not mgr.tree.root and node.pages[Tier.L2]:
            assert not torch.isnan(mgr.l2.page_buffer[torch.tensor(node.pages[Tier.L2])]).any()


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(CASES))
async def test_a_restore_or_prefetch_of_a_suspect_prefix_is_stopped_and_its_request_recomputes(case):
    """B's restore (or prefetch) of its pages past HEAD is held in flight, B waiting for it, when A
    reuses the corrupt HEAD from L1 and fails. Once the copy settles: the op ended CANCELLED without
    publishing, B recomputed its whole prompt and got the no-cache output (regression: B restored
    on top of the corrupt HEAD and failed too), only A failed, no tier serves the corrupt prefix and
    every tier's accounting is whole. The prompt is then cached again, clean."""
    source, overlap, held = CASES[case]
    eng = _engine(restore_overlap=overlap)
    await eng.start()
    want = await reference(PROMPT)
    await _corrupt_then_below_l1(eng, source)
    release = _hold(eng, source, overlap)

    b = eng.add_request(PROMPT, PARAMS)
    if overlap:  # admitted: its forward ran behind the held copy, its output waits for the op
        await until(lambda: b.overlap_result is not None)
        op = b.overlap_op
    else:
        await until(lambda: b in eng.parked)
        op = b.restore_op or b.prefetch_op
    assert op.kind is {"l2": OpKind.RESTORE_L2, "l3": OpKind.PREFETCH_L3}[source] and op.state is held, op
    eng.check_integrity()

    bad = await run_one(eng, A_PROMPT)
    assert bad.cached_tokens["l1"] == HEAD and bad.finish_reason == "error" and "NaN" in bad.error, bad
    eng.check_integrity()
    release()
    b_tokens, b_reason = await read_stream(b)
    # (regression: "error", its logits NaN)
    assert (b_reason, b_tokens) == ("length", want), (b_reason, b.error)
    assert sum(b.hit_tokens.values()) == 0  # it recomputed its whole prompt
    await eng.cache.drain()
    # it stopped at its next step, publishing nothing (regression, taken on: it published its L2
    # pages once verified, H2D_PENDING, then stopped)
    assert [state for state, _ in op.history[-2:]] == [held, OpState.CANCELLED], op.history
    metrics = eng.metrics()
    assert metrics["failures"].get("nan_logits") == 1 and metrics["fallbacks"] == 1, metrics["failures"]
    _tree_pages_finite(eng)
    assert_whole(eng.cache)
    # B's recompute cached the prompt again, clean, in every tier: the next request hits it
    assert _lengths(eng) == [REUSABLE] * 3
    again = await run_one(eng)
    assert (again.output_ids, again.cached_tokens["l1"]) == (want, REUSABLE)
    await finish(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("held", [OpState.S2H_PENDING, OpState.H2D_PENDING])
async def test_an_l3_restore_of_a_suspect_prefix_publishes_nothing_and_the_prefix_goes_once_it_ended(held):
    """A blocking L3 restore (RESTORE_L3: the engine's loop waits for it, so no request fails beside
    it there) held in `held` when its prefix's head is dropped as suspect: its L3 source (reading)
    or its promoted L2 pages (published, read by its H2D) stay under its locks; it stops without
    publishing more (regression: it published its L1 copy, and its L2 one stayed), and once it
    ended no tier holds the prefix, no L1 page is NaN and every tier is whole."""
    mgr = make_manager()
    tokens = tuple(range(24))
    write_prefix(mgr, tokens)
    await mgr.drain()
    mgr.tree.evict(Tier.L1, 100)
    mgr.tree.evict(Tier.L2, 100)
    m = mgr.tree.match(tokens, touch=False)
    assert m.lengths == [0, 0, 24]
    if held is OpState.S2H_PENDING:
        release = ReadGate(mgr.store).release
    else:
        release = TransferGate(SimpleNamespace(cache=mgr), "h2d").release.set
    op = mgr.runner.start_restore(tokens, m, "l3", "r")
    await until(lambda: op.state is held)
    if held is OpState.H2D_PENDING:  # its read brought NaN (a NaN page backed up passes its
        # checksum), published in L2, and its H2D copied it into its L1 pages (on the CPU when enqueued)
        mgr.l2.page_buffer[torch.tensor(mgr.tree.match(tokens, touch=False).pages[Tier.L2])] = float("nan")
        mgr.l1.kv[:, :, torch.tensor(op.payload["l1_pages"])] = float("nan")
    dropped, kept_tokens = drop_suspect_prefix(mgr, tokens[:16])
    assert kept_tokens == 16 and op.payload["cancel"], (dropped, kept_tokens)  # (locked: kept)
    mgr.check_integrity()
    release()
    await mgr.drain()
    assert [state for state, _ in op.history[-2:]] == [held, OpState.CANCELLED], op.history
    assert mgr.tree.match(tokens, touch=False).lengths == [0, 0, 0]
    assert not torch.isnan(mgr.l1.kv).any()  # its L1 pages went back zeroed
    assert mgr.metrics.cancellations == 1
    assert_whole(mgr)
    await mgr.close()

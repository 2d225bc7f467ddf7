"""Admission rules (scheduler/admission.py) that session 67's mutation check found unwatched, pinned by its second
half: an admission's hit is noted (write_through_selective backs a prefix up once it is hit again), a request whose
restore must wait for the L1 room a backup frees stops the prefill pass (the requests behind it do not take that
room first), and a request whose own prefetch brings its prefix parks on it rather than waiting for a request in
prefill that computes that prefix. And a backup (hicache/backups.py): a write probe of refused L2 writes goes past
the checks that refused them, and a shutdown's save for other instances under write_through_selective saves only
what that policy chose to. Each test names its mutant (/tmp/hunt_mutcore67/mutants_a.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hicache.ops import OpState
from hicache.radix import Tier
from hicache_helpers import make_manager, toks, write_prefix
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestState, SamplingParams
from test_mutation_loop_s64 import _prefix_in_l2_only


@pytest.mark.asyncio
async def test_write_through_selective_backs_up_a_prefix_once_a_second_admission_hits_it():
    """Admission notes each request's hit (`note_hit`): under write_through_selective a prefix computed once is
    not backed up, nor on its first hit, but its second hit starts its backup to L2 (A28: admissions noted
    nothing, and nothing was ever backed up)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4)
                 .with_hicache(enable=True, policy="always", transfer_backend="torch", storage_ratio=0.0,
                               write_policy="write_through_selective"))
    prefix = [(i * 7) % 89 + 1 for i in range(16)]

    async def run(last: int) -> list[int]:
        await eng.generate_async([prefix + [last]], SamplingParams(max_tokens=1))
        await eng.stop_loop()
        await eng.cache.drain()
        return eng.cache.tree.match(prefix, touch=False).lengths

    assert await run(90) == [16, 0, 0]  # computed: no hit
    assert await run(91) == [16, 0, 0]  # its first hit
    assert await run(92) == [16, 16, 0]  # its second: backed up
    eng.check_integrity()


@pytest.mark.asyncio
async def test_a_request_whose_restore_waits_for_l1_room_stops_the_prefill_pass():
    """A request whose restore could not start because the L1 room it needs is on its way (backups copying the
    leaves it would evict: `_try_restore` "wait") waits as one blocked for memory: the pass stops there, so the
    requests queued behind it are not admitted ahead of it onto that room (A22: it was skipped like a parked
    one, and the next request was admitted)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4)
                 .with_hicache(enable=True, policy="always", transfer_backend="torch", storage_ratio=0.0))
    prefix, _ = await _prefix_in_l2_only(eng)
    assert eng.cache.tree.match(prefix, touch=False).lengths[:2] == [0, 16]
    head = eng.add_request(prefix + [2, 3], SamplingParams(max_tokens=1))
    behind = eng.add_request(list(range(200, 220)), SamplingParams(max_tokens=1))
    eng.cache.runner.start_restore = lambda *args, **kwargs: None  # (no L1 pages for its copy now ...)
    eng.cache.l1_room_coming = lambda: True  # (... but a backup's copy frees them)
    assert await eng.admission.prefill_batch() is None
    assert list(eng.waiting) == [head, behind] and not eng.running
    assert head.restore_tier == "none" and head.restore_op is None


@pytest.mark.asyncio
async def test_a_request_whose_own_prefetch_brings_its_prefix_does_not_wait_for_a_sharer():
    """The shared-prefill wait (`_computes_prefix_of`) is for a request that would compute its prefix: one whose
    prefetch is reading that prefix from L3 parks on its prefetch (keeping L1 room for its H2D) although a
    request in prefill computes the same prefix (A6: it stayed queued behind that one, its read landing for
    no one until the sharer published)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=400))
    shared = list(range(100, 180))
    other = eng.add_request(shared + list(range(300, 320)), SamplingParams(max_tokens=1))
    assert (await eng.admission.prefill_batch()).reqs == [other]  # (in prefill: its first chunk not run yet)
    req = eng.add_request(shared + list(range(400, 420)), SamplingParams(max_tokens=1))
    assert eng.admission._computes_prefix_of(req) is other  # (without its prefetch it would wait)
    req.prefetch_op = SimpleNamespace(done=False, state=OpState.S2H_PENDING, payload={"l3_end": 80})
    await eng.admission.prefill_batch()
    assert req.state is RequestState.PARKED and list(eng.parked) == [req] and not eng.waiting
    assert req.reserved_pages == 20 == eng.admission.reserved_pages - other.reserved_pages


@pytest.mark.parametrize("probe", [False, True])
@pytest.mark.asyncio
async def test_a_write_probe_backs_up_to_l2_past_the_checks_that_refuse_the_backup(probe):
    """An L2 write that the cost model lets through as its probe of refused writes (`cost.write_probe`) is made
    although the checks after it refuse it (they price the same estimate, or L2's reuse gate): without it L2
    writes, once refused, were never timed again. Refused otherwise, a `write_l2` policy skip (B4: the probe was
    refused like the rest)."""
    mgr = make_manager(storage_pages=0)
    mgr.backup_pays_off = lambda num_tokens: False  # (L2's reuse gate refuses every backup)
    mgr.cost.write_probe = probe
    a = toks((0, 8))
    write_prefix(mgr, a)
    await mgr.drain()
    assert mgr.tree.match(a, touch=False).lengths[Tier.L2] == (8 if probe else 0)
    assert mgr.metrics.policy_skips["write_l2"] == (0 if probe else 1)
    mgr.check_integrity()
    await mgr.close()


@pytest.mark.asyncio
async def test_a_shutdown_save_under_write_through_selective_saves_no_leaf_the_policy_did_not_choose():
    """`save_for_others` backs up every unsaved L1 leaf under write_back (its dirty pages) and write_through
    (its refused backups) only: write_through_selective saved what it chose to, a prefix hit twice, and a prefix
    computed once stays unsaved at shutdown as it was while the engine ran (B12: every leaf was written to L2
    and the shared or kept L3)."""
    mgr = make_manager(write_policy="write_through_selective")
    mgr.store.persistent = True  # (a file kept for the next engine: the save runs)
    a = toks((0, 8))
    write_prefix(mgr, a)
    await mgr.drain()
    await mgr.runner.save_for_others(30.0)
    assert mgr.tree.match(a, touch=False).lengths == [8, 0, 0]
    assert mgr.metrics.backups_started == 0
    mgr.check_integrity()
    await mgr.close()

"""Mutation check (session 62) of hicache/backups.py, manager.py, simulated.py, log_gate.py and
kernels/chooser.py: rules no test pinned, each test named after what a user would notice."""
from __future__ import annotations

import asyncio

import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole, hold_copies, make_manager, toks, write_prefix


def lengths(mgr, *prefixes) -> list[list[int]]:
    return [mgr.tree.match(p, touch=False).lengths for p in prefixes]


@pytest.mark.asyncio
async def test_a_write_back_flush_of_l1_drops_a_leaf_l3_holds_without_copying_it_to_l2_again():
    """The flush's own veto (not only an allocation's): under write_back an L1 leaf that L3 holds
    (L2 evicted it) is saved, so `flush(Tier.L1)` evicts it at once; only the unsaved leaf is backed
    up and kept for now."""
    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=16, write_policy="write_back")
    a, b = toks((0, 8)), toks((100, 108))
    write_prefix(mgr, a)
    mgr.runner.start_backup(a)
    await mgr.drain()
    mgr.tree.evict(Tier.L2, 2)  # a: L1 + L3
    write_prefix(mgr, b)
    assert lengths(mgr, a, b) == [[8, 0, 8], [8, 0, 0]]
    assert mgr.flush(Tier.L1) == 2  # a goes; b's backup starts and b stays until saved
    assert lengths(mgr, a, b) == [[0, 0, 8], [8, 0, 0]]
    assert mgr.metrics.backups_started == 2
    await mgr.drain()
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_write_back_flush_keeps_a_leaf_whose_backup_waits_for_a_siblings():
    """Two L1 leaves share a prefix that L2 lacks: the flush's veto starts one leaf's backup and the
    other's waits for it (it would copy the shared page too). The waiting leaf is kept in L1 as the
    running one is, not evicted unsaved: after the backups, both whole prompts are in L2."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=0, write_policy="write_back")
    x, y = toks((0, 4), (10, 14)), toks((0, 4), (20, 24))
    write_prefix(mgr, x)
    write_prefix(mgr, y, 4)
    assert lengths(mgr, x, y) == [[8, 0, 0], [8, 0, 0]]
    mgr.flush(Tier.L1)
    assert lengths(mgr, x, y) == [[8, 0, 0], [8, 0, 0]], "a leaf whose backup waits was evicted unsaved"
    await mgr.drain()
    assert lengths(mgr, x, y) == [[8, 8, 0], [8, 8, 0]]
    assert mgr.metrics.backups_started == 2
    assert_whole(mgr)


def test_simulated_pool_bytes_counts_an_owner_entry_a_page_and_the_check_over_the_largest_tier():
    from hicache import simulated

    assert simulated.simulated_pool_bytes([10, 20, 30]) == 8 * 60 + 18 * 30
    assert simulated.simulated_pool_bytes([]) == 0


def test_the_memory_limit_is_the_least_of_physical_memory_ulimit_and_cgroup(monkeypatch):
    """memory_limit_bytes (L2 held to host memory, --simulate's refusal): physical memory; an address-space
    limit or a cgroup's memory.max below it wins; "max" and an unlimited ulimit mean no limit there."""
    import io
    import os
    import resource

    from hicache import simulated

    files = {}

    def fake_open(path, *a, **k):
        if path not in files:
            raise OSError(path)
        return io.StringIO(files[path])
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}[name])
    rlimit = [resource.RLIM_INFINITY]
    monkeypatch.setattr(resource, "getrlimit", lambda which: (rlimit[0], resource.RLIM_INFINITY))
    monkeypatch.setattr(simulated, "open", fake_open, raising=False)
    assert simulated.memory_limit_bytes() == 4_096_000
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert simulated.memory_limit_bytes() == 4_096_000
    files["/sys/fs/cgroup/memory.max"] = "1000000\n"
    files["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = "9999999999\n"
    assert simulated.memory_limit_bytes() == 1_000_000
    rlimit[0] = 500_000
    assert simulated.memory_limit_bytes() == 500_000


def test_simulated_copies_report_their_bytes_and_extents():
    from hicache.geometry import KVGeometry
    import torch

    from hicache.simulated import NullStore, NullTransferEngine

    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    tr = NullTransferEngine(geometry).d2h([1, 2, 3], [7, 8, 9])
    assert (tr.num_pages, tr.num_bytes) == (3, 3 * geometry.bytes_per_page)
    res = NullStore(geometry, 16).write_pages(None, [0, 1, 2, 3], [5, 6, 7, 8]).result()
    assert res == NullStore(geometry, 16).read_pages([5, 6, 7, 8], None, [0, 1, 2, 3]).result()
    assert res[0] == 4 * geometry.bytes_per_page and res[1] == 1  # one contiguous extent


def _chooser():
    from kernels import chooser
    from test_kernels import small_pool
    return chooser, small_pool()


def test_the_chooser_decides_gather_on_gather_timings_and_scatter_on_scatter_timings(monkeypatch):
    chooser, l1 = _chooser()
    monkeypatch.setattr(chooser, "_timing_enabled", lambda l1: True)
    fake = {"gather_triton": 110.0, "gather_torch": 100.0, "scatter_triton": 90.0, "scatter_torch": 100.0}
    monkeypatch.setattr(chooser, "_time_directions", lambda l1, n, r: dict(fake))
    c = chooser.choose_backends(l1, "auto")
    assert (c.gather, c.scatter) == ("torch", "triton")


def test_the_chooser_times_the_sample_asked_for_and_at_least_one_page(monkeypatch):
    """num_pages_sample is the sample timed; the default sample is ~64 MiB of pages, never 0 pages
    (a page larger than the target: one page)."""
    chooser, l1 = _chooser()
    monkeypatch.setattr(chooser, "_timing_enabled", lambda l1: True)
    seen = []
    monkeypatch.setattr(chooser, "_time_directions", lambda l1, n, r: seen.append(n) or dict.fromkeys(
        ("gather_triton", "gather_torch", "scatter_triton", "scatter_torch"), 1.0))
    chooser.choose_backends(l1, "auto", num_pages_sample=2)
    page_bytes = l1[:, :, 0].numel() * l1.element_size()
    monkeypatch.setattr(chooser, "_SAMPLE_TARGET_BYTES", 3 * page_bytes)
    chooser.choose_backends(l1, "auto")
    monkeypatch.setattr(chooser, "_SAMPLE_TARGET_BYTES", page_bytes // 2)
    chooser.choose_backends(l1, "auto")
    assert seen == [2, 3, 1]


def test_the_chooser_refuses_triton_whose_scatter_disagrees_or_that_is_unavailable(monkeypatch):
    chooser, l1 = _chooser()
    from kernels import page_copy

    with monkeypatch.context() as m:
        m.setattr(page_copy, "scatter_pages_triton", lambda packed, ids, pool: None)
        with pytest.raises(RuntimeError, match="scatter disagrees"):
            chooser.choose_backends(l1, "triton")
    monkeypatch.setattr(page_copy, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="unavailable"):
        chooser.choose_backends(l1, "triton")


def test_the_chooser_reports_microseconds_per_call(monkeypatch):
    """_time_us off CUDA: the mean of `repeats` calls (perf_counter), after two warm-up calls."""
    import torch

    chooser, _ = _chooser()
    clock = [0.0]
    monkeypatch.setattr(chooser.time, "perf_counter", lambda: clock[0])

    def call():
        clock[0] += 0.5
    assert chooser._time_us(call, torch.device("cpu"), repeats=4) == pytest.approx(0.5e6)


def test_the_quiet_log_drops_debug_and_info_only_and_info_enabled_follows_it(monkeypatch):
    import structlog

    from hicache import log_gate

    for level in ("debug", "info"):
        with pytest.raises(structlog.DropEvent):
            log_gate.drop_below_warning(None, level, {})
    assert log_gate.drop_below_warning(None, "warning", {"a": 1}) == {"a": 1}
    cfg = structlog.get_config()
    try:
        structlog.configure(processors=[log_gate.drop_below_warning, *cfg["processors"]])
        assert not log_gate.info_enabled()
        structlog.configure(processors=[])
        assert log_gate.info_enabled()
    finally:
        structlog.configure(processors=cfg["processors"])


@pytest.mark.asyncio
async def test_a_flush_of_l1_starts_the_due_write_through_backups_before_it_evicts():
    """A step's write-through backups wait for its clients (`backup_soon`); a flush of L1 in between
    starts them first (they lock their pages), so the prefix reaches L2 instead of being dropped."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=0)
    mgr.defer_backups = True
    a = toks((0, 16))
    write_prefix(mgr, a)
    assert mgr.runner.has_due
    mgr.flush(Tier.L1)
    await mgr.drain()
    assert lengths(mgr, a)[0][1] == 16, "the flush dropped a prefix whose backup was due"
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_shutdown_save_stops_after_a_round_that_saved_nothing():
    """save_for_others backs up unsaved leaves in rounds while a round saves something; a leaf that
    cannot be saved (longer than all of L2) ends it after one round, not rounds until the timeout."""
    mgr = make_manager(l1_pages=8, host_pages=2, storage_pages=16, write_policy="write_back")
    mgr.store.persistent = True  # (as --hicache-storage-persist: the file outlives the process)
    write_prefix(mgr, toks((0, 16)))
    rounds, real = [], mgr.runner.write_back_l1

    async def counted(*args, **kwargs):
        rounds.append(1)
        assert len(rounds) < 4, "rounds went on although none saved anything"
        return await real(*args, **kwargs)
    mgr.runner.write_back_l1 = counted
    await mgr.runner.save_for_others(5.0)
    assert len(rounds) == 1 and lengths(mgr, toks((0, 16)))[0] == [16, 0, 0]
    await mgr.drain()
    assert_whole(mgr)


def test_release_claim_frees_its_pages_and_forgets_the_claim():
    """A released claim's pages go back and the claim is closed: claims do not pile up over requests,
    and a stale claim cannot allocate again."""
    from hicache.allocator import AllocatorError

    mgr = make_manager(l1_pages=8, host_pages=8, storage_pages=0)
    claim = mgr.new_claim("req")
    assert len(mgr.alloc_l1(3, claim)) == 3
    labels = len(mgr.allocator(Tier.L1).claim_labels)
    assert mgr.release_claim(claim) == 3
    assert mgr.l1.allocator.num_free == 8 and len(mgr.allocator(Tier.L1).claim_labels) == labels - 1
    with pytest.raises(AllocatorError, match="unknown claim"):
        mgr.alloc_l1(1, claim)


@pytest.mark.asyncio
async def test_an_allocation_evicts_only_what_it_lacks():
    """alloc_l1 evicts LRU leaves for the pages the free list lacks, not for all it asks: the newer
    prefix stays an L1 hit."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=0)
    a, b = toks((0, 8)), toks((100, 108))
    write_prefix(mgr, a)
    write_prefix(mgr, b)
    await mgr.drain()
    claim = mgr.new_claim("req")
    assert len(mgr.alloc_l1(5, claim)) == 5  # 4 free + a's 2 pages
    assert lengths(mgr, a, b) == [[0, 8, 0], [8, 8, 0]]
    assert mgr.metrics.evictions_pages["l1"] == 2
    mgr.release_claim(claim)
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_check_integrity_fails_on_a_broken_tree_op_count_or_store():
    """Each of check_integrity's three parts can fail: the tree's counts, the op counters (an op
    started but neither ended nor running), and the L3 store (a tree page no longer readable)."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=16)
    a = toks((0, 8))
    write_prefix(mgr, a)
    await mgr.drain()
    assert lengths(mgr, a) == [[8, 8, 8]]
    mgr.check_integrity()
    mgr.tree.num_resident_pages[Tier.L1] += 1
    with pytest.raises(AssertionError, match="resident count"):
        mgr.check_integrity()
    mgr.tree.num_resident_pages[Tier.L1] -= 1
    mgr.metrics.backups_started += 1
    with pytest.raises(AssertionError, match="ops started"):
        mgr.check_integrity()
    mgr.metrics.backups_started -= 1
    slot = mgr.tree.match(a, include_storage=True, touch=False).pages[Tier.L3][0]
    mgr.store.invalidate([slot])
    with pytest.raises(AssertionError, match="not readable"):
        mgr.check_integrity()


@pytest.mark.asyncio
async def test_write_through_selective_backs_up_a_prefix_on_its_second_hit():
    """write_through_selective: a prefix is backed up once it was hit twice, not on its first hit; a hit
    counts for every node of its path (a shared prefix, hit through two prompts: its second hit, session 80);
    a hit that L1 lacks (an L2 hit) backs up nothing."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=0, write_policy="write_through_selective")
    x, y, z = toks((0, 4), (10, 14)), toks((0, 4), (20, 24)), toks((0, 4), (30, 34))
    write_prefix(mgr, x)
    write_prefix(mgr, y, 4)
    mgr.note_hit(x, mgr.match(x))
    await mgr.drain()
    assert mgr.metrics.backups_started == 0, "backed up on a first hit"
    mgr.note_hit(y, mgr.match(y))  # the shared page's second hit
    await mgr.drain()
    assert lengths(mgr, x, y) == [[8, 4, 0], [8, 4, 0]] and mgr.metrics.backups_started == 1
    mgr.note_hit(z, mgr.match(z))  # the shared page alone: its third hit, L2 holds it
    await mgr.drain()
    assert mgr.metrics.backups_started == 1
    mgr.note_hit(x, mgr.match(x))  # x's second hit
    await mgr.drain()
    assert lengths(mgr, x) == [[8, 8, 0]] and mgr.metrics.backups_started == 2
    mgr.flush(Tier.L1)
    mgr.note_hit(x, mgr.match(x))  # in L2 only
    await mgr.drain()
    assert mgr.metrics.backups_started == 2
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_l1_room_saved_returns_once_one_backup_copied_its_pages():
    """A caller waiting for L1 room (`l1_room_saved`) resumes when the first of the copying backups has
    copied its L1 pages, not after all of them."""
    mgr = make_manager(l1_pages=8, host_pages=16, storage_pages=0)
    gates = hold_copies(mgr, each=True)
    write_prefix(mgr, toks((0, 8)))
    write_prefix(mgr, toks((100, 108)))
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(gates) == 2 and mgr.l1_room_coming()
    waiter = asyncio.ensure_future(mgr.l1_room_saved())
    gates[0].set()
    for _ in range(20):
        await asyncio.sleep(0)
    done = waiter.done()
    gates[1].set()
    await waiter
    await mgr.drain()
    assert done, "waited for every backup"
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_backup_waiting_for_its_prefixs_starts_once_that_ones_l3_write_starts():
    """A backup deferred behind its prefix's backup starts once that one's L3 write started (its
    pages are in L2, locked by the write), not after slow storage finished it."""
    from hicache_helpers import WriteGate

    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64)
    writes = WriteGate(mgr.store)
    gate = hold_copies(mgr)
    a = toks((0, 8))
    ab = a + toks((100, 108))
    write_prefix(mgr, a)
    write_prefix(mgr, ab, 8)  # deferred behind a's backup (its D2H held)
    assert mgr.metrics.backups_started == 1
    gate.set()
    for _ in range(300):
        if lengths(mgr, ab)[0][1] == 16:
            break
        await asyncio.sleep(0.01)
    in_l2 = lengths(mgr, ab)[0]
    writes.release()
    await mgr.drain()
    assert in_l2[1] == 16, f"the extension waited for the L3 write: {in_l2}"
    assert lengths(mgr, ab) == [[16, 16, 16]]
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_cancelling_drain_drops_the_backups_waiting_for_a_stopped_one():
    """A drain that cancels (shutdown) stops the backup in flight; the backup deferred behind it is
    dropped with it, not started on the tiers being closed."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    gate = hold_copies(mgr)
    a = toks((0, 8))
    write_prefix(mgr, a)
    write_prefix(mgr, a + toks((100, 108)), 8)  # deferred behind a's backup
    drain = asyncio.ensure_future(mgr.drain(cancel=True))
    for _ in range(5):
        await asyncio.sleep(0)
    gate.set()
    await drain
    await mgr.drain()
    assert mgr.metrics.backups_started == 1, "a deferred backup started after the cancelling drain"
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_a_backup_whose_driver_task_is_cancelled_drops_the_ones_waiting_for_it():
    """A backup driver cancelled as a task (a loop shutting down), not through `cancel`, drops the
    backups deferred behind it as a cancelling drain does: none starts from a cancelled task."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    gate = hold_copies(mgr)
    a = toks((0, 8))
    write_prefix(mgr, a)
    write_prefix(mgr, a + toks((100, 108)), 8)
    for _ in range(5):
        await asyncio.sleep(0)
    (task,) = mgr.runner._tasks.values()
    task.cancel()
    gate.set()
    await mgr.drain()
    assert mgr.metrics.backups_started == 1, "a deferred backup started from a cancelled driver"
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_sibling_l3_writes_past_a_shared_prefix_l3_holds_do_not_wait_for_each_other():
    """Two prompts share a page that L3 holds and differ after it: their L3 writes write different
    pages, so neither waits for the other's (only a write of the same next page is waited for)."""
    from hicache_helpers import WriteGate

    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=64)
    s = toks((0, 4))
    write_prefix(mgr, s)
    await mgr.drain()
    writes = WriteGate(mgr.store)
    calls, held = [], mgr.store.write_pages
    mgr.store.write_pages = lambda *args, **kwargs: calls.append(1) or held(*args, **kwargs)
    write_prefix(mgr, s + toks((10, 14)), 4)
    write_prefix(mgr, s + toks((20, 24)), 4)
    for _ in range(300):
        if len(calls) == 2:
            break
        await asyncio.sleep(0.01)
    issued = len(calls)
    writes.release()
    await mgr.drain()
    assert issued == 2, "one sibling's L3 write waited for the other's"
    assert_whole(mgr)


@pytest.mark.asyncio
async def test_backups_waiting_for_a_prefix_that_succeeded_start_side_by_side():
    """Two extensions deferred behind their prefix's backup both start as it succeeds (they copy
    different pages); only after a failure does the first go alone."""
    mgr = make_manager(l1_pages=16, host_pages=32, storage_pages=0)
    gates = hold_copies(mgr, each=True)
    a = toks((0, 8))
    write_prefix(mgr, a)
    write_prefix(mgr, a + toks((100, 104)), 8)
    write_prefix(mgr, a + toks((200, 204)), 8)
    for _ in range(5):
        await asyncio.sleep(0)
    gates[0].set()
    for _ in range(20):
        await asyncio.sleep(0)
    started = mgr.metrics.backups_started
    for gate in gates:
        gate.set()
    for _ in range(20):
        await asyncio.sleep(0)
    for gate in gates:
        gate.set()
    await mgr.drain()
    assert started == 3, "the second extension waited for the first"
    assert_whole(mgr)

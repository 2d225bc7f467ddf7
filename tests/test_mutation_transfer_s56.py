"""Session 56 mutation check of the transfer engine and its neighbours (hicache/transfer.py,
transfer_layered.py, transfer_record.py, layer_copy.py, workspaces.py): rules that a mutant could
break with every earlier test still passing, each pinned here by what a caller or an operator sees.
All on the CPU (transfers there are copied inside their enqueue)."""
from __future__ import annotations

import time

import pytest
import torch

from hicache.pools import DevicePool, HostPool
from hicache.transfer import TransferEngine, TransferError
from hicache.transfer_record import Transfer
from hicache.workspaces import Workspaces
from kernels.chooser import ChosenBackends
from test_transfer import GEOM, _engine_with_random_l2, _same, layouts

MS = 1_000_000


def _engine() -> tuple[DevicePool, HostPool, TransferEngine]:
    l1, l2 = DevicePool(GEOM, 32, torch.device("cpu")), HostPool(GEOM, 64, pin=False)
    return l1, l2, TransferEngine(l1, l2, ChosenBackends("torch", "torch", {}, "test"))


def test_an_empty_or_mismatched_page_list_is_refused_as_a_transfer_error():
    """A transfer of no pages, either direction, is refused with the engine's own TransferError
    (what its callers catch), not an IndexError from deep inside the enqueue."""
    _, _, engine = _engine()
    with pytest.raises(TransferError):
        engine.d2h([], [])
    with pytest.raises(TransferError):
        engine.h2d([], [])
    engine.close()


def test_a_layer_ordered_restore_of_no_pages_is_declined_and_mismatched_lists_are_refused():
    """h2d_layerwise of no pages answers None (nothing to do), and L1 and L2 page lists of different
    lengths are refused with TransferError, as h2d refuses them, not a ValueError of the planner."""
    _, _, engine = _engine()
    assert engine.h2d_layerwise([], []) is None
    with pytest.raises(TransferError):
        engine.h2d_layerwise([20, 21, 22], [4, 5])
    engine.close()


def test_a_layer_ordered_restore_too_fragmented_for_the_layer_plan_is_declined_on_the_cpu():
    """Without the copy kernel (the CPU), a restore whose pages split in more runs than the 2-D plan
    takes is declined (None: the caller restores it by h2d), touching no L1 page; h2d then moves it."""
    l1, l2, engine = _engine_with_random_l2()
    host, dst = list(range(0, 24, 2)), list(range(4, 16))  # 12 runs of one page
    assert engine.h2d_layerwise(host, dst) is None
    assert not l1.kv.any()
    engine.wait_blocking(engine.h2d(host, dst))
    assert _same(l1.kv[:, :, dst], l2.page_buffer[host].permute(1, 2, 0, 3, 4, 5))
    engine.close()


def test_a_fragmented_backup_that_could_not_be_enqueued_writes_nothing_into_l2(monkeypatch):
    """A backup into scattered L2 pages whose gather could not be launched fails, and its completion
    does not run the CPU index copy: the pinned workspace (still holding the previous backup's bytes)
    is not copied into the failed backup's L2 pages."""
    import hicache.transfer as transfer_mod

    l1, l2, engine = _engine()
    l1.kv.view(torch.int16).random_(1, 30000)
    first = layouts(12)["scattered"]
    engine.wait_blocking(engine.d2h(list(range(12)), first))  # leaves its bytes in the idle workspace
    second = [p for p in range(64) if p not in first][::2][:12]  # 12 runs: the same CPU-gather path
    assert len(second) == 12
    before = l2.page_buffer.clone()

    def broken(*args, **kwargs):
        raise RuntimeError("launch refused")
    monkeypatch.setattr(transfer_mod, "gather_pages", broken)
    tr = engine.d2h(list(range(12, 24)), second)
    with pytest.raises(TransferError, match="launch refused"):
        engine.wait_blocking(tr)
    assert _same(l2.page_buffer, before)
    engine.close()


def test_a_first_transfers_workspace_allocation_is_not_its_recurring_cost(monkeypatch):
    """The one-time allocation of a workspace is the transfer's setup, not its enqueue: on the CPU,
    where the recurring cost the model learns is the enqueue, a slow first allocation (1 s on a fake
    clock here) must not be learned as copy time."""
    _, _, engine = _engine_with_random_l2()
    clock = [10 ** 12]

    def tick() -> int:
        clock[0] += 1_000
        return clock[0]
    monkeypatch.setattr(time, "monotonic_ns", tick)
    real = engine.workspaces.acquire

    def slow_allocation(num_pages, needs_host):
        ws, _ = real(num_pages, needs_host)
        clock[0] += 10 ** 9
        return ws, 10 ** 9
    monkeypatch.setattr(engine.workspaces, "acquire", slow_allocation)
    tr = engine.h2d(list(range(20, 28)), list(range(4, 12)))
    engine.wait_blocking(tr)
    assert tr.setup_ns == 10 ** 9
    assert tr.recurring_ns < 10 ** 6 and tr.enqueue_ns < 10 ** 6  # fake-clock ticks, not the allocation
    engine.close()


@pytest.mark.asyncio
async def test_a_transfer_awaited_twice_is_completed_once():
    """Awaiting a fragmented backup again (another waiter of the same operation) awaits the first
    completion: its CPU index copy into L2 runs once, not a second time from a workspace already
    given back to other transfers."""
    l1, l2, engine = _engine()
    l1.kv.normal_()
    host = layouts(12)["scattered"]
    tr = engine.d2h(list(range(12)), host)
    assert tr.finish is not None
    calls, finish = [], tr.finish
    tr.finish = lambda: (calls.append(1), finish())
    await engine.wait(tr)
    await engine.wait(tr)
    assert calls == [1]
    assert _same(l2.page_buffer[host], l1.kv[:, :, :12].permute(2, 0, 1, 3, 4, 5))
    engine.close()


@pytest.mark.asyncio
async def test_awaiting_a_transfer_copied_inside_its_enqueue_gives_its_workspace_back():
    """On the CPU a consecutive transfer is done when enqueued (no event, no finish); awaiting it
    still settles it: its workspace is free again and reused, so restore after restore keeps one
    workspace rather than allocating a new one each time."""
    _, _, engine = _engine_with_random_l2()
    for _ in range(3):
        tr = engine.h2d(list(range(20, 28)), list(range(4, 12)))
        assert tr.event is None and tr.finish is None
        await engine.wait(tr)
        assert tr.workspace is None and not tr.keepalive
        assert not any(w.busy for w in engine.workspaces)
    assert len(engine.workspaces) == 1
    engine.close()


def test_a_transfers_waits_are_never_negative_and_cpu_transfers_have_no_seen_wait():
    """The queue and seen waits reported per direction are never below 0: a CPU transfer awaited at
    once (its service is its enqueue) waited behind nothing, and without a device clock nothing can
    be seen late; on CUDA a device time shorter than the service plus the compute wait (clocks of
    two streams) is no wait either."""
    tr = Transfer("h2d", 8, 8 << 20, enqueue_ns=3 * MS, setup_ns=0, started_ns=0, synchronous=True)
    tr.done_ns, tr.service_ns = 3 * MS, 3 * MS
    assert tr.queue_wait_ns == 0
    assert tr.seen_wait_ns == 0
    tr.done_ns = 50 * MS  # awaited late (a forward ran first): still no device clock, no seen wait
    assert tr.seen_wait_ns == 0
    cuda = Transfer("h2d", 8, 8 << 20, enqueue_ns=1 * MS, setup_ns=0, started_ns=0, service_ns=9 * MS)
    cuda.done_ns, cuda.device_ns, cuda.compute_wait_ns = 12 * MS, 5 * MS, 1 * MS
    assert cuda.queue_wait_ns == 0


def test_a_cpu_backups_index_copy_at_completion_is_part_of_its_cost():
    """A transfer copied inside its enqueue costs its enqueue plus the CPU index copy run at its
    completion (a backup into scattered L2 pages): both are its own work, and the model learns both."""
    tr = Transfer("d2h", 12, 12 << 20, enqueue_ns=2 * MS, setup_ns=0, started_ns=0, synchronous=True)
    tr.finish_ns = 5 * MS
    assert tr.recurring_ns == 7 * MS


def test_layer_copies_refuse_a_non_contiguous_buffer():
    """The CPU's 2-D copies write through a flat byte view: a non-contiguous destination would be
    copied into a temporary and the write silently lost, so it is refused."""
    from hicache.layer_copy import page_out_copies, run_copies_cpu

    l1 = torch.randn(GEOM.l1_shape(8)).to(torch.bfloat16)
    dst = torch.zeros(GEOM.page_major_shape(8), dtype=torch.bfloat16).transpose(0, 1)
    copies = page_out_copies(GEOM, 8, [1, 2], [0, 1])
    with pytest.raises(ValueError, match="contiguous"):
        run_copies_cpu(copies, dst, l1)


def test_a_workspace_of_exactly_the_size_asked_is_reused():
    """Transfers of one length, one after another, share one workspace (allocating one costs far
    more than the copy): an idle workspace of exactly the pages asked fits."""
    pool = Workspaces(GEOM, torch.device("cpu"))
    ws, _ = pool.acquire(4, needs_host=False)
    pool.release(ws)
    again, _ = pool.acquire(4, needs_host=False)
    assert again is ws and len(pool) == 1


def test_of_two_idle_workspaces_of_one_size_the_one_with_its_pinned_half_is_kept():
    """When two idle workspaces of one size meet, the one kept is the one whose pinned half was
    already allocated, so the next fragmented transfer does not pin memory again."""
    pool = Workspaces(GEOM, torch.device("cpu"))
    plain, _ = pool.acquire(4, needs_host=False)
    with_host, _ = pool.acquire(4, needs_host=True)
    assert with_host is not plain and with_host.host is not None
    pool.release(with_host)
    pool.release(plain)
    assert list(pool) == [with_host]


def test_a_node_given_a_tail_again_counts_as_the_most_recent():
    """The tails table keeps the `capacity` nodes most recently given a tail: a node whose sequence
    finished again is the latest, so a newer node pushes out the one given its tail longest ago."""
    from hicache.continuations import Tails
    from test_radix import make_tree, put

    tree, allocs = make_tree(4)
    tails = Tails(capacity=2)
    nodes = []
    for i in range(3):
        put(tree, allocs, [i] * 4)
        nodes.append(tree.root.children[(i,) * 4])
    tails.put(nodes[0], [50])
    tails.put(nodes[1], [51])
    tails.put(nodes[0], [60])  # node 0's sequence finished again
    tails.put(nodes[2], [52])
    assert tails.get(tree, nodes[0]) == (60,)
    assert tails.get(tree, nodes[1]) == ()
    assert tails.get(tree, nodes[2]) == (52,)


def test_every_failure_of_a_kind_is_counted():
    """The failures an operator reads per kind (/metrics, /hicache/status) count each occurrence,
    not only whether one happened."""
    from hicache.metrics import Metrics

    metrics = Metrics()
    for _ in range(3):
        metrics.count_failure("transfer")
    metrics.count_failure("eio")
    assert metrics.as_dict()["failures"] == {"transfer": 3, "eio": 1}


@pytest.mark.asyncio
async def test_the_integrity_check_notices_an_l3_store_that_disagrees_with_the_tree():
    """check_integrity, which tests and benchmarks run between phases, fails when a page the tree
    holds in L3 is no longer readable in the store, and when a slot the tree freed still reads
    (a stale read of it would pass its checks)."""
    from hicache.allocator import FREE
    from hicache.radix import Tier
    from hicache_helpers import l3_only_chain, make_manager

    mgr = make_manager()
    _, m = await l3_only_chain(mgr)
    mgr.check_integrity()  # the store and the tree agree
    held = m.pages[Tier.L3]
    mgr.store.invalidate([held[0]])
    with pytest.raises(AssertionError, match="not readable"):
        mgr.check_integrity()
    await mgr.close()

    mgr = make_manager()
    await l3_only_chain(mgr)
    free = int((mgr.allocator(Tier.L3).owner == FREE).nonzero()[0][0])
    mgr.store.write_pages(mgr.l2.page_buffer, [0], [free]).result()  # a free slot left readable
    with pytest.raises(AssertionError, match="free slots still readable"):
        mgr.check_integrity()
    await mgr.close()


@pytest.mark.asyncio
async def test_a_tiers_status_counts_the_pages_requests_hold_privately():
    """/hicache/status's private_pages: pages a running request holds that the tree does not (yet)."""
    from hicache.radix import Tier
    from hicache_helpers import make_manager

    mgr = make_manager()
    claim = mgr.new_claim("writer")
    assert len(mgr.alloc_l1(3, claim)) == 3
    assert mgr.tier_status(Tier.L1)["private_pages"] == 3
    mgr.release_claim(claim)
    assert mgr.tier_status(Tier.L1)["private_pages"] == 0
    await mgr.close()


def test_triton_wins_a_direction_at_exactly_its_tolerance(monkeypatch):
    """The chooser's rule as documented: Triton takes gather when it is at most 5 % slower than
    torch, scatter at most 2 % (exactly at the band: Triton)."""
    from kernels import chooser
    from test_kernels import small_pool

    monkeypatch.setattr(chooser, "_timing_enabled", lambda l1: True)
    fake = {"gather_triton": 105.0, "gather_torch": 100.0, "scatter_triton": 102.0, "scatter_torch": 100.0}
    monkeypatch.setattr(chooser, "_time_directions", lambda l1, n, r: dict(fake))
    c = chooser.choose_backends(small_pool(), "auto")
    assert (c.gather, c.scatter) == ("triton", "triton")


def test_a_timing_sample_larger_than_the_pool_times_the_whole_pool(monkeypatch):
    """Asked to time more pages than L1 has, the chooser times every page of it rather than
    failing and falling back to torch."""
    from kernels import chooser
    from test_kernels import small_pool

    monkeypatch.setattr(chooser, "_timing_enabled", lambda l1: True)
    l1 = small_pool()
    c = chooser.choose_backends(l1, "auto", num_pages_sample=10 * l1.shape[2], repeats=1)
    assert "fell back" not in c.reason
    assert set(c.timings_us) == {"gather_triton", "gather_torch", "scatter_triton", "scatter_torch"}


def test_an_l2_asked_at_exactly_the_hosts_share_is_left_as_asked():
    """A ratio-sized L2 exactly at half the host's memory fits: the config is left as it was (no
    `l2_held_to_host_memory` warning, no size in GiB put in its place)."""
    from hicache.config import HiCacheConfig
    from scheduler.memory_plan import HOST_SHARE, host_config_within_memory

    bpp = 1 << 20
    hc = HiCacheConfig(enable=True, host_ratio=2.0)
    l1_pages = 1000
    limit = int(2 * l1_pages * bpp / HOST_SHARE)  # half of it is exactly the 2,000 pages asked
    assert host_config_within_memory(hc, l1_pages, bpp, limit) is hc
    assert host_config_within_memory(hc, l1_pages, bpp, limit - 2 * bpp) is not hc  # a page less: held


def test_only_a_regular_file_at_the_l3_path_counts_as_free_disk(tmp_path, monkeypatch):
    """The free space an L3 file is sized from counts the blocks of a regular file already at its
    path (the last run's L3, truncated into them); anything else there (a directory) adds nothing."""
    import os
    from types import SimpleNamespace

    from hicache.config import HiCacheConfig
    from scheduler.memory_plan import disk_free_bytes

    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=1000, f_frsize=4096))
    old = tmp_path / "l3.bin"
    old.write_bytes(b"x" * 8192)
    free_bytes = disk_free_bytes(HiCacheConfig(enable=True, storage_path=str(old)))
    assert free_bytes == 1000 * 4096 + os.stat(old).st_blocks * 512
    other = tmp_path / "a_directory"
    other.mkdir()
    assert disk_free_bytes(HiCacheConfig(enable=True, storage_path=str(other))) == 1000 * 4096

"""Session 66 mutation check of the transfer engine (hicache/transfer.py, transfer_layered.py,
transfer_plan.py, transfer_record.py, layer_copy.py, workspaces.py): rules a mutant could break with
every earlier test (tests/test_transfer.py, tests/test_mutation_transfer_s56.py, ...) still passing,
each pinned by what a caller, the cost model or an operator sees. All on the CPU, where a transfer
is copied inside its enqueue; the CUDA-only paths (streams, events, the pipeline, the copy kernels)
are left to tests/test_gpu_transfers.py."""
from __future__ import annotations

import time

import pytest
import torch

import hicache.transfer_layered as transfer_layered
from hicache.layer_copy import run_layer_cpu
from test_mutation_transfer_s56 import _engine
from test_transfer import _engine_with_random_l2, _same, layouts

MS = 1_000_000


def test_pages_whose_ends_look_consecutive_but_are_not_move_page_by_page():
    """The one-run check (one DMA for the whole transfer) must look at every page, not only at the
    first and last: L2 pages [20, 22, 21, 23] end where one run of four would, yet each page goes
    to its own L2 page, in both directions."""
    l1, l2, engine = _engine()
    l1.kv.view(torch.int16).random_(-30000, 30000)
    host, src = [20, 22, 21, 23], [3, 4, 5, 6]
    engine.wait_blocking(engine.d2h(src, host))
    assert _same(l2.page_buffer[host], l1.kv[:, :, src].permute(2, 0, 1, 3, 4, 5))
    dst = [10, 11, 12, 13]
    engine.wait_blocking(engine.h2d(host, dst))
    assert _same(l1.kv[:, :, dst], l1.kv[:, :, src])
    engine.close()


def test_a_transfer_waited_for_twice_on_this_thread_is_completed_once():
    """wait_blocking of a transfer already completed (by wait_blocking or by wait) does not complete
    it again: a fragmented backup's CPU index copy would run a second time, from a workspace already
    given back and taken by another transfer."""
    import asyncio

    l1, l2, engine = _engine()
    l1.kv.normal_()
    for first_wait in ("blocking", "async"):
        tr = engine.d2h(list(range(12)), layouts(12)["scattered"])
        assert tr.finish is not None
        calls, finish = [], tr.finish
        tr.finish = lambda: (calls.append(1), finish())
        if first_wait == "blocking":
            engine.wait_blocking(tr)
        else:
            asyncio.run(engine.wait(tr))
        engine.wait_blocking(tr)
        assert calls == [1], first_wait
    engine.close()


def test_a_completion_that_raises_still_gives_the_workspace_back():
    """A fragmented backup whose CPU index copy raises at completion: wait_blocking raises, and the
    transfer's workspace is free again (not held busy for good, which made every later transfer
    allocate a new one)."""
    l1, _, engine = _engine()
    tr = engine.d2h(list(range(12)), layouts(12)["scattered"])
    assert tr.workspace is not None and tr.finish is not None

    def broken():
        raise RuntimeError("index copy refused")
    tr.finish = broken
    with pytest.raises(RuntimeError, match="index copy refused"):
        engine.wait_blocking(tr)
    assert tr.workspace is None and not any(w.busy for w in engine.workspaces)
    engine.close()


def test_closing_the_engine_drops_its_workspaces():
    """close() lets go of the scratch buffers (pinned memory on CUDA), not only the waiter threads."""
    l1, _, engine = _engine()
    engine.wait_blocking(engine.d2h(list(range(12)), layouts(12)["scattered"]))
    assert len(engine.workspaces) == 1
    engine.close()
    assert len(engine.workspaces) == 0


def test_an_l1_pool_too_large_for_a_2d_dma_pitch_is_marked_for_the_copy_kernels(monkeypatch):
    """L1 slab rows farther apart than a 2-D DMA can step (`l1_pitch_fits`) count as narrow slabs
    (no direct pages, layer-ordered restores by the copy kernel) even when the slabs are wide."""
    import hicache.transfer as transfer_mod
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from kernels.chooser import ChosenBackends

    geo = KVGeometry(num_layers=2, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 8, torch.device("cpu")), HostPool(geo, 8, pin=False)
    backends = ChosenBackends("torch", "torch", {}, "test")
    assert not transfer_mod.TransferEngine(l1, l2, backends).narrow_slabs  # 32 KiB slabs: wide enough
    monkeypatch.setattr(transfer_mod, "l1_pitch_fits", lambda geometry, num_pages: False)
    assert transfer_mod.TransferEngine(l1, l2, backends).narrow_slabs


def test_the_layer_plan_of_a_restore_with_whole_pages_covers_only_the_rest(monkeypatch):
    """h2d_layerwise(..., whole_pages): the layer plan is made of the pages after the whole part.
    Here the whole part (L2 pages 10, 11) plus 8 single-page runs would be 9 runs, past the plan's
    limit: the restore is still taken (not declined to h2d), the whole pages by one scatter, and the
    2-D copies move each of the other 8 pages once per slab, not the whole pages again."""
    l1, l2, engine = _engine_with_random_l2()
    rows = []
    monkeypatch.setattr(transfer_layered, "run_layer_cpu",
                        lambda copies, *a: (rows.extend(c.height for c in copies), run_layer_cpu(copies, *a)))
    host = [10, 11] + list(range(20, 36, 2))  # 2 whole, then 8 runs of one page
    dst = list(range(2, 12))
    tr = engine.h2d_layerwise(host, dst, whole_pages=2)
    assert tr is not None
    engine.wait_blocking(tr)
    assert sum(rows) == 8 * 2 * engine.geometry.num_layers
    assert _same(l1.kv[:, :, dst], l2.page_buffer[host].permute(1, 2, 0, 3, 4, 5))
    engine.close()


def test_a_layer_ordered_restore_counts_every_page_and_its_enqueue_time(monkeypatch):
    """A layer-ordered restore is a cost-model sample like any other: its bytes are all its pages',
    and on the CPU (copied inside its enqueue) its recurring cost is the enqueue, copies included
    (a fake clock: each layer's copies take 5 ms)."""
    l1, l2, engine = _engine_with_random_l2()
    clock = [10 ** 12]
    monkeypatch.setattr(time, "monotonic_ns", lambda: clock[0])

    def slow_layer(copies, *args):
        clock[0] += 5 * MS
        run_layer_cpu(copies, *args)
    monkeypatch.setattr(transfer_layered, "run_layer_cpu", slow_layer)
    tr = engine.h2d_layerwise(list(range(20, 26)), list(range(4, 10)))
    assert tr.num_bytes == 6 * engine.geometry.bytes_per_page
    engine.wait_blocking(tr)
    layers = engine.geometry.num_layers
    assert tr.enqueue_ns == layers * 5 * MS and tr.recurring_ns == layers * 5 * MS
    engine.close()


def test_a_workspaces_pinned_half_is_reused_by_the_next_fragmented_transfer():
    """The pinned half of a workspace (fragmented L2 pages without the copy kernels) is allocated
    once: the next fragmented transfer taking that workspace reuses it rather than pinning memory
    again (a pinned allocation costs far more than the copy)."""
    l1, _, engine = _engine()
    scattered = layouts(12)["scattered"]
    first = engine.d2h(list(range(12)), scattered)
    pinned = first.workspace.host
    engine.wait_blocking(first)
    second = engine.h2d(scattered, list(range(12, 24)))
    assert second.workspace.host is pinned
    engine.wait_blocking(second)
    engine.close()


def test_a_page_list_given_back_is_reused_by_a_transfer_that_fills_it_exactly():
    """A copy kernel's page list holds 2 x its capacity entries; a later transfer of exactly that
    many pages takes it again instead of pinning a new one."""
    from hicache.workspaces import PageLists

    lists = PageLists(pin=False)
    buf, _ = lists.acquire(list(range(64)), list(range(64)))
    assert buf.numel() == 128
    lists.release(buf)
    again, pages = lists.acquire(list(range(100, 164)), list(range(64)))
    assert again is buf and pages[0].tolist() == list(range(100, 164))


def test_on_cuda_an_enqueue_longer_than_the_device_time_is_the_cost():
    """With the device clock, a transfer costs its enqueue or its device time past the compute wait,
    whichever is longer: an enqueue of 3 ms around a 1 ms copy costs 3 ms, not 1."""
    from hicache.transfer_record import Transfer

    tr = Transfer("h2d", 8, 8 << 20, enqueue_ns=3 * MS, setup_ns=0, started_ns=0, service_ns=1 * MS)
    tr.done_ns, tr.device_ns, tr.compute_wait_ns = 10 * MS, 2 * MS, 1 * MS
    assert tr.recurring_ns == 3 * MS


def test_a_synchronous_transfers_service_time_includes_its_completion_copy(monkeypatch):
    """A transfer copied inside its enqueue (the CPU) is serviced for its enqueue plus the `finish`
    run at its completion (a fragmented backup's CPU index copy): the service time the metrics report
    is both, as its recurring cost is (fake clock: the index copy takes 4 ms)."""
    from hicache.transfer_record import Transfer

    clock = [10 ** 12]
    monkeypatch.setattr(time, "monotonic_ns", lambda: clock[0])

    def index_copy():
        clock[0] += 4 * MS
    tr = Transfer("d2h", 12, 12 << 20, enqueue_ns=2 * MS, setup_ns=0, started_ns=clock[0], finish=index_copy,
                  synchronous=True)
    clock[0] += 2 * MS
    tr.complete()
    assert tr.finish_ns == 4 * MS
    assert tr.service_ns == 6 * MS == tr.recurring_ns

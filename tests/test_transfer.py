"""Transfer engine on the CPU: every host layout (one run, a few runs, scattered) moves the exact
bytes, and only scattered destinations need the pinned workspace and a CPU index copy (on CUDA with a
pinned L2 the copy kernels of kernels/host_copy.py take those instead: tests/test_gpu_transfers.py)."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.geometry import KVGeometry
from hicache.pools import DevicePool, HostPool
from hicache.transfer import TransferEngine
from hicache.transfer_plan import MAX_DMA_RUNS, host_runs, ramp_chunks
from kernels.chooser import ChosenBackends

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)


def layouts(n):
    rng = random.Random(0)
    few = [p for run in ([10 + i for i in range(5)], [40 + i for i in range(n - 5)]) for p in run]
    scattered = rng.sample(range(64), n)
    return {"consecutive": list(range(20, 20 + n)), "few_runs": few, "scattered": scattered}


@pytest.mark.parametrize("layout", ["consecutive", "few_runs", "scattered"])
def test_round_trip_is_exact_for_every_host_layout(layout):
    n = 12
    host_pages = layouts(n)[layout]
    assert (len(host_runs(host_pages)) == 1) == (layout == "consecutive")
    if layout == "scattered":
        assert len(host_runs(host_pages)) > MAX_DMA_RUNS
    l1 = DevicePool(GEOM, 32, torch.device("cpu"))
    l2 = HostPool(GEOM, 64, pin=False)
    l1.kv.view(torch.int16).random_(-30000, 30000)
    engine = TransferEngine(l1, l2, ChosenBackends("torch", "torch", {}, "test"))
    src = random.Random(1).sample(range(32), n)
    original = l1.kv[:, :, src].clone()
    engine.wait_blocking(engine.d2h(src, host_pages))
    assert torch.equal(l2.page_buffer[host_pages].view(torch.int16),
                       original.permute(2, 0, 1, 3, 4, 5).contiguous().view(torch.int16))
    dst = random.Random(2).sample(range(32), n)
    engine.wait_blocking(engine.h2d(host_pages, dst))
    assert torch.equal(l1.kv[:, :, dst].view(torch.int16), original.view(torch.int16))
    needs_host_workspace = layout == "scattered"
    assert any(w.host is not None for w in engine.workspaces) == needs_host_workspace
    engine.close()



def _same(a, b) -> bool:
    """Bit-equal (random bits include NaNs)."""
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def _engine_with_random_l2():
    l1 = DevicePool(GEOM, 32, torch.device("cpu"))
    l2 = HostPool(GEOM, 64, pin=False)
    l2.page_buffer.view(torch.int16).random_(-30000, 30000)
    return l1, l2, TransferEngine(l1, l2, ChosenBackends("torch", "torch", {}, "test"))


@pytest.mark.parametrize("host_pages, whole_pages, scattered", [
    (list(range(10, 16)), 0, 0),            # all in layers
    (list(range(10, 16)), 4, 4),            # 4 whole, then 2 in layers
    (list(range(10, 16)), 9, 5),            # at most all but one page whole
    ([10, 11, 20, 21, 22, 23], 2, 2),       # the whole part one run, the rest another
    ([10, 11, 20, 21, 22, 23], 3, 0),       # a whole part of two runs: all in layers
])
def test_a_layer_ordered_restore_may_move_its_first_pages_whole(host_pages, whole_pages, scattered, monkeypatch):
    """h2d_layerwise(..., whole_pages): the first pages (consecutive in L2) by one scatter before the
    layer plan takes the rest; every page lands in its L1 page either way, and nothing else moves."""
    import hicache.transfer_layered as transfer_mod

    l1, l2, engine = _engine_with_random_l2()
    seen = []
    real = transfer_mod.scatter_pages
    monkeypatch.setattr(transfer_mod, "scatter_pages", lambda packed, idx, *a, **k: (seen.append(len(idx)),
                                                                                    real(packed, idx, *a, **k)))
    dst = [3, 4, 5, 9, 10, 11]
    engine.wait_blocking(engine.h2d_layerwise(host_pages, dst, whole_pages=whole_pages))
    assert sum(seen) == scattered
    assert _same(l1.kv[:, :, dst], l2.page_buffer[host_pages].permute(1, 2, 0, 3, 4, 5))
    assert not l1.kv[:, :, sorted(set(range(32)) - set(dst))].any()
    engine.close()


def test_a_layer_copy_that_raises_fails_the_transfer_not_the_caller(monkeypatch):
    import hicache.transfer_layered as transfer_mod
    from hicache.transfer import TransferError

    l1, l2, engine = _engine_with_random_l2()
    calls = []

    def copy_twice_then_raise(*args):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("DMA refused")
        run_layer_cpu(*args)

    from hicache.layer_copy import run_layer_cpu
    monkeypatch.setattr(transfer_mod, "run_layer_cpu", copy_twice_then_raise)
    tr = engine.h2d_layerwise([7, 8], [0, 1])  # does not raise
    with pytest.raises(TransferError, match="layer 1 not copied"):
        engine.wait_blocking(tr)
    engine.close()


@pytest.mark.parametrize("num_pages", [1, 2, 3, 8, 51, 63, 219, 500, 4097])
def test_pipeline_chunks_start_small_and_grow_at_most_16_fold(num_pages):
    """The CUDA pipeline's chunks (hicache/transfer.py): every page once, the first chunk small (its
    gather is all that precedes the first DMA), each later one at most 16x the one before (its
    kernel must end under the previous chunk's DMA), and few of them (each costs the loop an enqueue)."""
    sizes = ramp_chunks(num_pages, 3, 16)
    assert sum(sizes) == num_pages and all(s >= 1 for s in sizes)
    assert sizes[0] == min(3, num_pages)
    assert all(b <= 16 * a for a, b in zip(sizes, sizes[1:]))
    assert len(sizes) <= 5
    with pytest.raises(ValueError):
        ramp_chunks(0, 3, 16)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_a_copy_that_cannot_be_enqueued_fails_the_transfer_not_the_caller(direction, monkeypatch):
    """A gather/scatter launch that raises (a Triton launcher error was one on the H200) fails that
    transfer: the call returns, the wait raises TransferError, and the workspace is free again."""
    import hicache.transfer as transfer_mod
    from hicache.transfer import TransferError

    def broken(*args, **kwargs):
        raise IndexError("tuple index out of range")
    monkeypatch.setattr(transfer_mod, "gather_pages" if direction == "d2h" else "scatter_pages", broken)
    l1, l2 = DevicePool(GEOM, 32, torch.device("cpu")), HostPool(GEOM, 64, pin=False)
    engine = TransferEngine(l1, l2, ChosenBackends("torch", "torch", {}, "test"))
    tr = engine.d2h([1, 2, 3], [4, 5, 6]) if direction == "d2h" else engine.h2d([4, 5, 6], [1, 2, 3])
    assert tr.fail and "not enqueued" in tr.error
    with pytest.raises(TransferError, match="tuple index out of range"):
        engine.wait_blocking(tr)
    assert not any(w.busy for w in engine.workspaces)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_page_out_copies_move_each_l1_page_into_its_page_major_page(seed):
    """A backup's direct first pages (hicache/transfer.py `direct_pages`): one 2-D copy per page
    takes its 2L slabs out of L1 (one slab row apart) and packs them into the destination page,
    exactly as gathering that page would; nothing else in the destination is touched."""
    from hicache.layer_copy import page_out_copies, run_copies_cpu

    rng = random.Random(seed)
    geo = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)
    l1_num = 24
    l1 = torch.randn(geo.l1_shape(l1_num)).to(torch.bfloat16)       # [2, L, P, S, H, D]
    dst = torch.zeros(geo.page_major_shape(10), dtype=torch.bfloat16)  # [n, 2, L, S, H, D]
    l1_pages, dst_pages = rng.sample(range(l1_num), 6), rng.sample(range(10), 6)
    copies = page_out_copies(geo, l1_num, l1_pages, dst_pages)
    assert len(copies) == 6 and all(c.height == 2 * geo.num_layers for c in copies)
    run_copies_cpu(copies, dst, l1)
    for src, d in zip(l1_pages, dst_pages):
        assert torch.equal(dst[d], l1[:, :, src])
    untouched = sorted(set(range(10)) - set(dst_pages))
    assert not dst[untouched].any()
    with pytest.raises(ValueError):
        page_out_copies(geo, l1_num, [1, 2], [0])


@pytest.mark.parametrize("num_pages", [1, 7, 15, 55, 56, 120, 493, 4000])
def test_gathered_chunks_after_the_direct_pages(num_pages):
    """A D2H after 7 direct pages (the 8B shape): every remaining page once, the first gathered
    chunk up to 14 pages (it runs under the direct DMAs), few chunks, no tail smaller than the first."""
    from hicache.transfer_plan import gathered_chunks

    sizes = gathered_chunks(num_pages, 7, 3)
    assert sum(sizes) == num_pages and all(s >= 1 for s in sizes)
    assert sizes[0] == min(14, num_pages) or sizes == [num_pages]  # 15 pages: one chunk, not 14 + 1
    assert len(sizes) == 1 or sizes[-1] >= sizes[0]
    assert len(sizes) <= 4


def test_consecutive_host_pages_in_a_tuple_take_the_one_run_path():
    """The consecutive check compares against a range as a list; page lists handed over as tuples
    must still count as one run (not as fragmented pages needing a workspace and a CPU gather)."""
    l1, l2 = DevicePool(GEOM, 32, torch.device("cpu")), HostPool(GEOM, 32, pin=False)
    l1.kv.normal_()
    engine = TransferEngine(l1, l2, ChosenBackends("torch", "torch", {}, "test"))
    tr = engine.d2h(tuple(range(4, 14)), tuple(range(20, 30)))
    assert tr.workspace is not None and tr.workspace.host is None  # no pinned half: not the CPU-gather path
    engine.wait_blocking(tr)
    assert torch.equal(l2.buffer[:, :, 20:30], l1.kv[:, :, 4:14])
    engine.close()


def test_waiting_for_the_callers_stream_is_not_the_transfers_cost():
    """A transfer enqueued behind a forward still running on the caller's stream waits for it, but a
    recompute would too: that wait (compute_wait_ns) is left out of the recurring time the cost model
    learns and the metrics report, and out of the queue wait (regression: a busy trace replay's
    restores measured ~77 ms of forwards each, the model learned H2D at 4.5 GiB/s and stopped
    restoring and backing up; docs/benchmarks.md, session 16)."""
    from hicache.metrics import DirectionStats
    from hicache.transfer import Transfer

    ms = 1_000_000
    tr = Transfer("h2d", 8, 8 << 20, enqueue_ns=1 * ms, setup_ns=2 * ms, started_ns=0, service_ns=3 * ms)
    tr.done_ns = 90 * ms
    tr.compute_wait_ns = 80 * ms
    assert tr.recurring_ns == 90 * ms - 2 * ms - 80 * ms
    assert tr.queue_wait_ns == 90 * ms - 1 * ms - 2 * ms - 80 * ms - 3 * ms
    stats = DirectionStats()
    stats.add(tr.num_bytes, enqueue_s=0.001, setup_s=0.002, compute_wait_s=0.08, queue_wait_s=tr.queue_wait_ns / 1e9,
              service_s=0.003, end_to_end_s=0.09)
    assert stats.recurring_s == pytest.approx(tr.recurring_ns / 1e9)
    assert stats.as_dict()["compute_wait_s"] == pytest.approx(0.08)
    tr.compute_wait_ns = 0  # nothing before it: end to end less setup, as before
    assert tr.recurring_ns == 88 * ms


def test_on_cuda_when_a_thread_saw_the_transfer_done_is_not_its_cost():
    """Regression (session 17, a busy trace replay on the H200): restores were seen done ~100 ms
    after their copies ended on the device (the threads that wait for them ran late); that delay was
    in the cost model's samples, which learned H2D at 3.9 GiB/s and stopped restoring. With the
    device clock (`device_ns`, enqueue to the end of the copy) the sample is the enqueue or the device
    time past the compute wait, whichever is longer, plus a CPU `finish`; the rest is `seen_wait_ns`."""
    from hicache.metrics import DirectionStats
    from hicache.transfer import Transfer

    ms = 1_000_000
    tr = Transfer("h2d", 8, 8 << 20, enqueue_ns=1 * ms, setup_ns=2 * ms, started_ns=0, service_ns=9 * ms)
    tr.done_ns, tr.compute_wait_ns, tr.device_ns = 120 * ms, 4 * ms, 15 * ms
    assert tr.recurring_ns == 15 * ms - 4 * ms
    assert tr.queue_wait_ns == 15 * ms - 4 * ms - 9 * ms  # behind other work on its stream
    assert tr.seen_wait_ns == 120 * ms - 2 * ms - 15 * ms
    tr.finish_ns = 5 * ms  # a CPU index copy after the device was done: the transfer's own work
    assert tr.recurring_ns == 16 * ms and tr.seen_wait_ns == 98 * ms
    tr.device_ns, tr.compute_wait_ns, tr.finish_ns = 2 * ms, 1 * ms, 0  # the enqueue outlasted the copy
    assert tr.recurring_ns == 1 * ms
    stats = DirectionStats()
    stats.add(tr.num_bytes, end_to_end_s=0.12, seen_wait_s=tr.seen_wait_ns / 1e9, recurring_s=tr.recurring_ns / 1e9)
    assert stats.recurring_s == pytest.approx(0.001) and stats.as_dict()["seen_wait_s"] == pytest.approx(0.116)


def test_a_restores_completion_never_waits_behind_backups():
    """Completions are awaited on worker threads; a restore's (H2D) must not queue behind backups'
    (D2H) still in flight, however many (regression: one pool of two workers for both directions
    left a busy trace replay's restores waiting ~19 ms a restore behind 759 backups' completions;
    docs/benchmarks.md, session 16). Backups here block in their completion until released."""
    import asyncio
    import threading

    from hicache.transfer import Transfer

    geo = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32)
    te = TransferEngine(DevicePool(geo, 8, torch.device("cpu")), HostPool(geo, 8, pin=False),
                        ChosenBackends("torch", "torch"))
    release = threading.Event()

    def transfer(direction: str, finish) -> Transfer:
        return Transfer(direction, 1, geo.bytes_per_page, 0, 0, 0, finish=finish)

    async def scenario() -> bool:
        backups = [asyncio.ensure_future(te.wait(transfer("d2h", release.wait))) for _ in range(4)]
        await asyncio.sleep(0.05)  # the backups hold whatever workers they can
        try:
            await asyncio.wait_for(te.wait(transfer("h2d", lambda: None)), 2.0)
            restored_first = not any(b.done() for b in backups)
        finally:
            release.set()
            await asyncio.gather(*backups)
        return restored_first

    assert asyncio.run(scenario())
    te.close()


@pytest.mark.parametrize("page_size,narrow", [(1, True), (8, True), (16, False), (32, False)])
def test_slabs_narrower_than_a_good_dma_row_are_marked_for_the_copy_kernels(page_size, narrow):
    """The 8B shape's slab is 2 KiB a token: below MIN_DMA_ROW_BYTES (32 KiB) a restore's 2-D DMAs
    crawl, so on CUDA such restores take the copy kernel at any length and backups no direct
    pages (tests/test_gpu_transfers.py and tests/test_gpu.py run both); `min_dma_row_bytes` moves the line."""
    from hicache.layer_copy import MIN_DMA_ROW_BYTES

    geo = KVGeometry(num_layers=2, num_kv_heads=8, head_dim=128, page_size=page_size, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 8, torch.device("cpu")), HostPool(geo, 8, pin=False)
    backends = ChosenBackends("torch", "torch", {}, "test")
    assert MIN_DMA_ROW_BYTES == 32 << 10
    assert TransferEngine(l1, l2, backends).narrow_slabs == narrow
    assert not TransferEngine(l1, l2, backends, min_dma_row_bytes=0).narrow_slabs


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=60), st.lists(st.integers(0, 3), min_size=1, max_size=60),
       st.one_of(st.none(), st.integers(1, 10)))
def test_consecutive_runs_equal_a_plain_scan(pages, l1_steps, max_runs):
    """The run finder gives exactly the runs of a page-by-page scan, of one list or of two in step,
    and None past max_runs (where it stops scanning: one-token pages make lists of thousands)."""
    from hicache.layer_copy import page_runs
    from hicache.transfer_plan import consecutive_runs

    def plain(*lists):
        runs, first = [], 0
        for i in range(1, len(lists[0]) + 1):
            if i == len(lists[0]) or any(xs[i] != xs[i - 1] + 1 for xs in lists):
                runs.append((first, i))
                first = i
        return runs

    # runs of consecutive pages more likely than chance: each entry is the one before + 1 or a jump
    host = [pages[0]]
    for p in pages[1:]:
        host.append(host[-1] + 1 if p % 3 else p)
    l1 = [10]
    for s in l1_steps[1:len(host)]:
        l1.append(l1[-1] + s)
    l1 += list(range(l1[-1] + 1, l1[-1] + 1 + len(host) - len(l1)))
    want = plain(host)
    got = consecutive_runs(host, max_runs=max_runs)
    assert got == (want if max_runs is None or len(want) <= max_runs else None)
    assert host_runs(tuple(host)) == [(i0, i1, host[i0]) for i0, i1 in want]
    want2 = plain(l1, host)
    assert page_runs(l1, host) == want2
    assert page_runs(l1, host, max_runs=max_runs) == (want2 if max_runs is None or len(want2) <= max_runs else None)


def test_consecutive_runs_of_long_lists():
    from hicache.transfer_plan import consecutive_runs

    long = list(range(5, 8005))
    assert consecutive_runs(long) == [(0, 8000)]
    split = long[:3000] + list(range(20000, 25000))
    assert consecutive_runs(split) == [(0, 3000), (3000, 8000)]
    assert consecutive_runs(list(range(0, 16000, 2)), max_runs=8) is None


@pytest.mark.parametrize("direction", ["d2h", "h2d", "h2d_layerwise"])
def test_a_copy_done_inside_its_enqueue_costs_its_enqueue(direction):
    """On the CPU a transfer is copied inside its enqueue; it used to be timed to its completion,
    which an overlapped restore reaches only after its tail's forward: the cost model learned the
    forward as the copy (a tiny-model smoke run saw H2D at 0.02 GiB/s)."""
    import time

    l1 = DevicePool(GEOM, 32, torch.device("cpu"))
    l2 = HostPool(GEOM, 64, pin=False)
    engine = TransferEngine(l1, l2, ChosenBackends("torch", "torch", {}, "test"))
    l1_pages, host_pages = list(range(4, 12)), list(range(20, 28))
    tr = (engine.d2h(l1_pages, host_pages) if direction == "d2h" else
          engine.h2d(host_pages, l1_pages) if direction == "h2d" else engine.h2d_layerwise(host_pages, l1_pages))
    assert tr is not None and tr.synchronous
    time.sleep(0.3)  # a forward runs before anyone awaits the transfer
    engine.wait_blocking(tr)
    assert tr.end_to_end_ns >= 300_000_000
    assert tr.recurring_ns == tr.enqueue_ns + tr.finish_ns == tr.service_ns
    assert tr.recurring_ns <= tr.end_to_end_ns - 300_000_000  # the sleep is not the copy's
    engine.close()


@pytest.mark.asyncio
async def test_a_cancelled_waiter_leaves_the_buffers_to_the_copy_until_it_settled():
    """wait() gave the workspace back when its waiter was cancelled, while the copy (here: the CPU
    index copy of a fragmented D2H, held back) still wrote from it: the next transfer could take it."""
    import asyncio
    import threading

    l1 = DevicePool(GEOM, 32, torch.device("cpu"))
    l2 = HostPool(GEOM, 64, pin=False)
    engine = TransferEngine(l1, l2, ChosenBackends("torch", "torch", {}, "test"))
    tr = engine.d2h(list(range(12)), layouts(12)["scattered"])
    assert tr.finish is not None and tr.workspace is not None
    hold, real_finish = threading.Event(), tr.finish
    tr.finish = lambda: (hold.wait(10), real_finish())
    waiter = asyncio.ensure_future(engine.wait(tr))
    await asyncio.sleep(0.05)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert [w.busy for w in engine.workspaces] == [True]  # still the copy's
    hold.set()
    for _ in range(500):
        if not any(w.busy for w in engine.workspaces):
            break
        await asyncio.sleep(0.01)
    assert [w.busy for w in engine.workspaces] == [False]
    engine.close()


def test_a_transfer_wait_blocking_completed_is_not_completed_again_by_wait():
    """Session 39. Regression: `wait_blocking` settled a transfer by hand (it kept the sources alive) and
    left no completion, so a later `wait` ran a fragmented D2H's `finish` (its CPU index copy) again,
    from a workspace already given back."""
    import asyncio
    geometry = KVGeometry(2, 2, 8, 4, torch.float32)
    l1, l2 = DevicePool(geometry, 64, torch.device("cpu")), HostPool(geometry, 64, pin=False)
    engine = TransferEngine(l1, l2, ChosenBackends("torch", "torch", {}, "test"))
    l1.kv.normal_()
    tr = engine.d2h(list(range(20)), list(range(0, 40, 2)))  # 20 runs of one page: a CPU index copy at the end
    assert tr.finish is not None
    calls, finish = [], tr.finish
    tr.finish = lambda: (calls.append(1), finish())
    engine.wait_blocking(tr)
    assert not tr.keepalive and tr.workspace is None
    asyncio.run(engine.wait(tr))
    assert calls == [1]
    assert torch.equal(l2.buffer[:, :, 0:40:2], l1.kv[:, :, :20])

"""Session 69 mutation check of the transfer engine's records and planners (hicache/transfer_record.py,
workspaces.py, transfer_plan.py, layer_copy.py, kernel_calibration.py): rules a mutant could break with
every earlier test (tests/test_transfer.py, test_mutation_transfer_s56.py, test_mutation_transfer_s66.py,
test_workspaces.py, test_page_lists.py, test_kernel_calibration.py, ...) still passing.

All on the CPU. `Transfer.complete` on CUDA only reads its events (`query`, `synchronize`,
`elapsed_time`), so stand-in events on a fake device clock pin how it turns them into the timings the
cost model learns. `calibrate` only asks its engine for layer-ordered restores and their times, so a
scripted stand-in engine pins its bookkeeping (which path each probe takes, which run counts, what it
sets); the timing itself on CUDA is tests/test_kernel_calibration.py's GPU test."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from hicache.geometry import KVGeometry
from hicache.kernel_calibration import REPEATS, RestoreTimes, calibrate, kernel_max_pages
from hicache.layer_copy import layer_plan, page_out_copies, run_copies_cpu
from hicache.transfer_record import Transfer
from hicache.workspaces import PageLists, Workspaces

MS = 1_000_000
GEOM = KVGeometry(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


class DeviceEvent:
    """A CUDA event's stand-in at `at_ms` on the device clock; reports done on its `done_after`-th query."""

    def __init__(self, at_ms: float, done_after: int = 1) -> None:
        self.at_ms, self.done_after, self.queries, self.synchronized = at_ms, done_after, 0, False

    def query(self) -> bool:
        self.queries += 1
        return self.queries >= self.done_after

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, other: "DeviceEvent") -> float:
        return other.at_ms - self.at_ms


@pytest.fixture
def clock(monkeypatch):
    now = [10 ** 12]
    monkeypatch.setattr(time, "monotonic_ns", lambda: now[0])
    return now


def _cuda_transfer(clock, enqueued: float, ready: float, start: float, end: float, **kw) -> Transfer:
    tr = Transfer("h2d", 8, 8 << 20, enqueue_ns=kw.pop("enqueue_ns", 2 * MS), setup_ns=kw.pop("setup_ns", 0),
                  started_ns=clock[0], event=DeviceEvent(end, kw.pop("done_after", 1)),
                  start_event=DeviceEvent(start), enqueued_event=DeviceEvent(enqueued), ready_event=DeviceEvent(ready),
                  **kw)
    return tr


# -- transfer_record.py: Transfer.complete on the device clock -----------------------------------------------------
def test_a_cuda_completion_reads_service_device_and_compute_wait_each_from_its_own_events(clock):
    """Enqueued at 0 on the device clock, the caller's stream ready at 1 ms, the copy from 1.5 to 5 ms: the
    service is the copy (start to end), the device time runs from the enqueue, the compute wait to `ready`;
    the service the device measured is kept (not replaced by the host's end to end), and the cost is the
    device time past the compute wait."""
    tr = _cuda_transfer(clock, enqueued=0.0, ready=1.0, start=1.5, end=5.0)
    clock[0] += 20 * MS  # seen done late
    tr.complete()
    assert tr.event.synchronized
    assert tr.service_ns == 3_500_000
    assert tr.device_ns == 5 * MS
    assert tr.compute_wait_ns == 1 * MS
    assert tr.recurring_ns == 4 * MS and tr.queue_wait_ns == 500_000 and tr.seen_wait_ns == 15 * MS


def test_a_ready_event_timed_before_the_enqueue_is_no_compute_wait(clock):
    """Two streams' events: the caller's stream may read as ready 0.5 ms before the enqueue event. That is
    no wait, not a negative one that would add itself to the transfer's cost."""
    tr = _cuda_transfer(clock, enqueued=1.0, ready=0.5, start=1.2, end=3.0, enqueue_ns=1 * MS)
    clock[0] += 10 * MS
    tr.complete()
    assert tr.compute_wait_ns == 0
    assert tr.recurring_ns == 2 * MS


def test_a_compute_wait_is_never_longer_than_the_transfer_waited_after_its_setup_and_enqueue(clock):
    """Seen done 3 ms after it started, 0.5 ms of setup and 2 ms of enqueue: at most 0.5 ms of that can have
    been the wait for the caller's stream, whatever its events say (2.5 ms here)."""
    tr = _cuda_transfer(clock, enqueued=0.0, ready=2.5, start=2.6, end=2.9, setup_ns=500_000)
    clock[0] += 3 * MS
    tr.complete()
    assert tr.compute_wait_ns == 500_000


def test_a_polling_completion_queries_its_event_until_done(clock):
    """complete(poll=True) (EngineConfig.gpu_wait) keeps querying the event, the thread staying on the CPU,
    until the event reports done; without poll it never queries, only synchronizes."""
    tr = _cuda_transfer(clock, enqueued=0.0, ready=0.0, start=0.0, end=1.0, done_after=3)
    tr.complete(poll=True)
    assert tr.event.queries == 3 and tr.event.synchronized
    quiet = _cuda_transfer(clock, enqueued=0.0, ready=0.0, start=0.0, end=1.0, done_after=3)
    quiet.complete()
    assert quiet.event.queries == 0 and quiet.event.synchronized


def test_a_completion_without_events_times_its_finish_into_its_service(clock):
    """No device clock and not copied inside its enqueue (a completion run by a waiter thread): its service
    is from its start to when `finish` (4 ms) ended, less the one-time setup (2 ms), and so is its cost."""
    def index_copy():
        clock[0] += 4 * MS
    tr = Transfer("d2h", 12, 12 << 20, enqueue_ns=1 * MS, setup_ns=2 * MS, started_ns=clock[0], finish=index_copy)
    clock[0] += 10 * MS
    tr.complete()
    assert tr.finish_ns == 4 * MS and tr.end_to_end_ns == 14 * MS
    assert tr.service_ns == 12 * MS == tr.recurring_ns


# -- workspaces.py ---------------------------------------------------------------------------------------------
def test_giving_back_workspaces_never_forgets_one_still_in_use():
    """Trimming the idle workspaces down to one keeps every busy one listed: the engine's checks (and close)
    see the workspace a transfer still holds, and it is the one kept once given back as the largest."""
    pool = Workspaces(GEOM, torch.device("cpu"))
    held, _ = pool.acquire(16, needs_host=False)
    a, _ = pool.acquire(2, needs_host=False)
    b, _ = pool.acquire(4, needs_host=False)
    pool.release(a)
    pool.release(b)
    assert list(pool) == [held, b] and held.busy
    pool.release(held)
    assert list(pool) == [held]


def test_a_page_list_taken_again_is_no_longer_idle():
    """A list given back and taken by one transfer is that transfer's: the next transfer gets another
    buffer, not the one the first is still writing and the kernel still reading."""
    lists = PageLists(pin=False)
    buf, _ = lists.acquire([1, 2, 3], [4, 5, 6])
    lists.release(buf)
    first, _ = lists.acquire([7, 8], [9, 10])
    second, pages = lists.acquire([11, 12], [13, 14])
    assert first is buf and second is not first
    assert first[:4].tolist() == [7, 8, 9, 10] and pages.tolist() == [[11, 12], [13, 14]]


def test_page_list_capacities_are_at_least_64_pages_and_a_power_of_two():
    """A new list holds 64 pages at least, else the next power of two of the pages asked, so a later
    transfer of a few more pages fits a list given back."""
    lists = PageLists(pin=False)
    assert [lists.acquire([0] * n, [0] * n)[0].numel() for n in (1, 3, 64, 65, 100, 128, 129)] == \
        [128, 128, 128, 256, 256, 256, 512]


def test_giving_back_no_page_list_leaves_the_idle_lists_usable():
    lists = PageLists(pin=False)
    lists.release(None)
    buf, _ = lists.acquire([1], [2])
    lists.release(buf)
    lists.release(None)
    assert lists._idle == [buf]
    assert lists.acquire([3], [4])[0] is buf


# -- layer_copy.py --------------------------------------------------------------------------------------------
def test_a_layer_plan_of_no_pages_is_refused():
    with pytest.raises(ValueError, match="layer_plan"):
        layer_plan(GEOM, 16, [], [])


def test_page_out_copies_add_each_base_to_its_own_side():
    """Given the buffers' addresses (CUDA), the destination offset is the page-major buffer's base plus its
    page, the source L1's base plus its slab row; copies planned at bases and run at offsets match."""
    slab, page_bytes = GEOM.slab_elements * GEOM.itemsize, GEOM.bytes_per_page
    plain = page_out_copies(GEOM, 8, [3, 5], [0, 1])
    based = page_out_copies(GEOM, 8, [3, 5], [0, 1], dst_base=1 << 40, src_base=1 << 20)
    assert [c.dst_offset_bytes - (1 << 40) for c in based] == [c.dst_offset_bytes for c in plain] == [0, page_bytes]
    assert [c.src_offset_bytes - (1 << 20) for c in based] == [c.src_offset_bytes for c in plain] \
        == [3 * slab, 5 * slab]
    l1 = torch.randn(GEOM.l1_shape(8))
    dst = torch.zeros(GEOM.page_major_shape(2))
    run_copies_cpu(plain, dst, l1)
    assert torch.equal(dst[1], l1[:, :, 5])


# -- kernel_calibration.py -------------------------------------------------------------------------------------
def test_a_kernel_exactly_at_the_margin_keeps_the_bound():
    """1.1 x the DMAs' 1 ms is exactly 1.1 ms: not over the margin, the bound stays; 1 ns more caps it."""
    dma = RestoreTimes(8, 200_000, 800_000)
    assert kernel_max_pages(RestoreTimes(8, 100_000, 1_000_000), dma, 256) == 256
    assert kernel_max_pages(RestoreTimes(8, 100_000, 1_000_001), dma, 256) < 256


class ScriptedEngine:
    """What `calibrate` asks of a CUDA TransferEngine, with each path's restore times scripted: a probe is by
    the kernel where its pages are within `kernel_max_pages`, by the DMAs otherwise; its device time is
    known once waited for (`wait_blocking`)."""

    def __init__(self, kernel_runs, dma_runs, l1_pages=1000, l2_pages=1000, bytes_per_page=2 << 20,
                 configured=256, **flags) -> None:
        self.cuda, self.host_reads, self.layerwise, self.narrow_slabs = True, True, True, False
        self.__dict__.update(flags)
        self.geometry = SimpleNamespace(bytes_per_page=bytes_per_page)
        self.l1, self.l2 = SimpleNamespace(num_pages=l1_pages), SimpleNamespace(num_pages=l2_pages)
        self.kernel_max_pages, self.faults = configured, object()
        self.runs = {True: list(kernel_runs), False: list(dma_runs)}
        self.calls: list[tuple] = []

    def h2d_layerwise(self, host_pages, l1_pages):
        by_kernel = len(l1_pages) <= self.kernel_max_pages
        self.calls.append((by_kernel, len(l1_pages), self.faults))
        script = self.runs[by_kernel].pop(0)
        if script is None:
            return None  # declined (too fragmented for this path)
        tr = Transfer("h2d", len(l1_pages), 0, enqueue_ns=script[0], setup_ns=0, started_ns=0)
        tr.device_after_wait = script[1]
        return tr

    def wait_blocking(self, tr) -> None:
        tr.service_ns = tr.device_after_wait


# the warm-up first (fastest of all: not to be counted), then REPEATS timed runs: the kernel's best the last,
# the DMAs' the first
KERNEL_RUNS = [(1_000, 1_000), (215_000, 4_300_000), (215_000, 4_250_000), (215_000, 4_170_000)]
DMA_RUNS = [(1_000, 1_000), (907_000, 2_780_000), (907_000, 2_900_000), (907_000, 2_850_000)]


def test_calibration_times_each_path_by_its_best_timed_run_and_sets_the_bound():
    """Sessions 61/68's slow kernel (tests/test_kernel_calibration.py's 27 pages): one untimed run then
    REPEATS timed, each path's fastest kept (enqueue and device time as measured, the device time once
    waited for); the bound the rule gives is set on the engine; the probe restores the pages both pools
    hold (L2's 56 here), the kernel path by the kernel and the DMA path by the DMAs, with no fault
    injector in place, which comes back after."""
    te = ScriptedEngine(KERNEL_RUNS, DMA_RUNS, l2_pages=56)
    faults = te.faults
    cal = calibrate(te, 256)
    assert len(KERNEL_RUNS) == len(DMA_RUNS) == REPEATS + 1
    assert cal.kernel == RestoreTimes(56, 215_000, 4_170_000)
    assert cal.dma == RestoreTimes(56, 907_000, 2_780_000)
    assert cal.configured_pages == 256 and cal.kernel_max_pages == 27 == te.kernel_max_pages
    assert te.calls == [(True, 56, None)] * (REPEATS + 1) + [(False, 56, None)] * (REPEATS + 1)
    assert te.faults is faults and not te.runs[True] and not te.runs[False]


def test_a_calibration_whose_kernel_keeps_up_keeps_the_bound_on_the_engine():
    fast = [(215_000, 2_782_000)] * (REPEATS + 1)
    te = ScriptedEngine(fast, DMA_RUNS, l1_pages=40, configured=128)
    cal = calibrate(te, 128)
    assert cal.kernel.pages == cal.dma.pages == 40 and cal.kernel_max_pages == 128 == te.kernel_max_pages


@pytest.mark.parametrize("declined", ["kernel", "dma"])
def test_a_probe_either_path_declines_changes_nothing(declined):
    """A probe restore declined (None: not at start, but then nothing can be compared) leaves the engine's
    bound as configured and gives no calibration."""
    runs = {"kernel": list(KERNEL_RUNS), "dma": list(DMA_RUNS)}
    runs[declined][1] = None
    te = ScriptedEngine(runs["kernel"], runs["dma"])
    assert calibrate(te, 256) is None
    assert te.kernel_max_pages == 256


@pytest.mark.parametrize("flags", [{"narrow_slabs": True}, {"layerwise": False}, {"host_reads": False},
                                   {"cuda": False}])
def test_no_calibration_where_one_path_is_missing(flags):
    """Slabs too narrow for 2-D DMAs, no layer-ordered restores, no copy kernel, or the CPU: one path only,
    so nothing is probed and the bound stays."""
    te = ScriptedEngine(KERNEL_RUNS, DMA_RUNS, **flags)
    assert calibrate(te, 256) is None
    assert te.calls == [] and te.kernel_max_pages == 256


def test_a_copy_done_inside_its_enqueue_counts_that_enqueue_once_in_its_queue_wait():
    """The CPU copies a transfer inside its enqueue: its service is that enqueue plus its finish, so the wait
    for its completion to be seen is the rest of its time (regression: the enqueue was taken off twice, 44 ms
    reported of 47)."""
    tr = Transfer("h2d", 8, 8 << 20, enqueue_ns=3_000_000, setup_ns=0, started_ns=0, synchronous=True)
    tr.service_ns, tr.done_ns = tr.enqueue_ns + tr.finish_ns, 50_000_000
    assert tr.queue_wait_ns == 47_000_000
    tr.synchronous, tr.service_ns = False, 2_000_000  # (asynchronous: its enqueue is not in its service)
    assert tr.queue_wait_ns == 45_000_000

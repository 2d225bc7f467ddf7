"""hicache/kernel_calibration.py: the bound on restores by the copy kernel, lowered at start where the
kernel's restore times slower than the DMAs' (a host whose SMs read pinned memory slowly: sessions
61 and 68), kept where it keeps up (session 69). The rule is checked with the figures of those
hosts; the probe's bookkeeping on the CPU's transfer engine; the timing itself on CUDA
(`test_calibration_times_both_paths_and_the_restores_after_it_land`, marked gpu)."""
from __future__ import annotations

import argparse

import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.faults import Fault, FaultInjector
from hicache.geometry import KVGeometry
from hicache.kernel_calibration import (MARGIN, PROBE_BYTES, RestoreTimes, _best, calibrate, kernel_max_pages,
                                        probe_pages)
from hicache.manager import CacheManager
from hicache.pools import DevicePool, HostPool
from hicache.transfer import TransferEngine
from kernels.chooser import choose_backends
from scheduler.config import add_engine_args, config_from_args

PAGES = 56  # the probe of the 8B / 4B shapes at page 16: 128 MiB


def test_a_kernel_that_keeps_up_keeps_the_configured_bound():
    """Session 69's H100 (run 4, 8B): the kernel 2.782 ms on the device after a 0.215 ms launch, the DMAs
    2.780 after a 0.907 ms enqueue: the kernel's restore is the faster, the bound stays."""
    kernel, dma = RestoreTimes(PAGES, 215_000, 2_782_000), RestoreTimes(PAGES, 907_000, 2_780_000)
    assert kernel_max_pages(kernel, dma, 256) == 256


def test_a_kernel_slower_by_no_more_than_the_margin_keeps_the_bound():
    dma = RestoreTimes(PAGES, 907_000, 2_780_000)
    just = RestoreTimes(PAGES, 215_000, int((1 + MARGIN) * dma.total_ns) - 215_000)
    assert kernel_max_pages(just, dma, 256) == 256
    over = RestoreTimes(PAGES, 215_000, just.device_ns + 1_000)
    assert kernel_max_pages(over, dma, 256) < 256


def test_a_slow_kernel_keeps_only_restores_its_launch_saving_pays_for():
    """Sessions 61 and 68's hosts: the kernel at 29.5 GiB/s, 4.17 ms for the probe's 128 MiB, against the
    DMAs' 2.78: 1.39 ms more for 56 pages (24,821 ns a page), 0.692 ms of enqueue saved: 27 pages."""
    kernel, dma = RestoreTimes(PAGES, 215_000, 4_170_000), RestoreTimes(PAGES, 907_000, 2_780_000)
    assert kernel_max_pages(kernel, dma, 256) == 27
    assert kernel_max_pages(kernel, dma, 8) == 8  # (never above the configured bound)


def test_a_slow_kernel_that_saves_no_enqueue_takes_no_restore():
    kernel, dma = RestoreTimes(PAGES, 950_000, 4_170_000), RestoreTimes(PAGES, 907_000, 2_780_000)
    assert kernel_max_pages(kernel, dma, 256) == 0


def test_the_two_paths_must_time_the_same_pages():
    with pytest.raises(ValueError, match="same pages"):
        kernel_max_pages(RestoreTimes(PAGES, 1, 1), RestoreTimes(PAGES - 1, 1, 1), 256)
    with pytest.raises(ValueError, match="same pages"):
        kernel_max_pages(RestoreTimes(0, 1, 1), RestoreTimes(0, 1, 1), 256)


def test_a_probe_restores_about_probe_bytes_within_the_bound_and_both_pools():
    page_bytes = 2_359_296  # the 8B shape's 16-token page
    assert probe_pages(page_bytes, 256, 10_000, 10_000) == PROBE_BYTES // page_bytes == 56
    assert probe_pages(page_bytes, 40, 10_000, 10_000) == 40
    assert probe_pages(page_bytes, 256, 30, 10_000) == 30
    assert probe_pages(page_bytes, 256, 10_000, 12) == 12
    assert probe_pages(PROBE_BYTES * 2, 256, 10, 10) == 1  # (a page over PROBE_BYTES: one page)
    assert probe_pages(page_bytes, 0, 10_000, 10_000) == 0  # (the kernel takes none: nothing to time)


def _cpu_transfer(kernel_max=16, faults=None) -> TransferEngine:
    geo = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    l1, l2 = DevicePool(geo, 32, torch.device("cpu")), HostPool(geo, 32, pin=False)
    return TransferEngine(l1, l2, choose_backends(l1.kv, "torch"), faults, kernel_max_pages=kernel_max)


def test_the_probe_restores_the_bound_and_the_faults_it_set_aside():
    """`_best` times one path by setting the transfer engine's bound (and sets its fault injector aside: a
    fault is meant for a request's transfer); both come back, and no fault was spent on the probe."""
    faults = FaultInjector()
    faults.arm(Fault.TRANSFER_RAISE, times=None)
    te = _cpu_transfer(faults=faults)
    te.l2.page_buffer.copy_(torch.randn(te.l2.page_buffer.shape))
    for by_kernel in (True, False):
        times = _best(te, list(range(8)), by_kernel)
        assert times is not None and times.pages == 8 and times.total_ns > 0
        assert te.kernel_max_pages == 16 and te.faults is faults
    assert faults.fired[Fault.TRANSFER_RAISE] == 0 and faults.is_armed(Fault.TRANSFER_RAISE)
    assert torch.equal(te.l1.kv[:, :, :8], te.l2.page_buffer[:8].permute(1, 2, 0, 3, 4, 5))  # (it did restore)


def test_a_failed_probe_changes_nothing(monkeypatch):
    te = _cpu_transfer()

    def failing(*args, **kwargs):
        from hicache.transfer_record import TransferError
        raise TransferError("h2d: injected")
    monkeypatch.setattr(te, "wait_blocking", failing)
    assert _best(te, list(range(8)), by_kernel=True) is None
    assert te.kernel_max_pages == 16


def test_no_calibration_without_the_copy_kernel():
    """The CPU has one path (no kernel reads pinned L2): nothing is timed, nothing changes."""
    te = _cpu_transfer()
    assert calibrate(te, 16) is None and te.kernel_max_pages == 16
    geo = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
    mgr = CacheManager(geo, 16, "cpu", HiCacheConfig(enable=True, host_ratio=2.0))
    assert mgr.kernel_calibration is None and mgr.transfer.kernel_max_pages == 4096 // 4


def test_the_calibration_is_on_by_default_and_a_flag_turns_it_off():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--enable-hicache"])).hicache.kernel_calibration is True
    args = parser.parse_args(["--enable-hicache", "--disable-hicache-kernel-calibration"])
    assert config_from_args(args).hicache.kernel_calibration is False
    with pytest.raises(ValueError, match="kernel_calibration must be True or False"):
        HiCacheConfig(kernel_calibration="no")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_calibration_times_both_paths_and_the_restores_after_it_land():
    """On CUDA, the 8B shape's slabs (wide enough for 2-D DMAs): both paths are timed over the same
    pages, the bound it sets is the rule's, and a restore after it (by whichever path) lands byte for byte."""
    geo = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 160, torch.device("cuda")), HostPool(geo, 160, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "triton"), kernel_max_pages=256)
    assert te.host_reads and te.layerwise and not te.narrow_slabs
    cal = calibrate(te, 256)
    assert cal is not None and cal.kernel.pages == cal.dma.pages == probe_pages(geo.bytes_per_page, 256, 160, 160)
    assert cal.kernel.device_ns > 0 and cal.dma.device_ns > 0 and cal.kernel.enqueue_ns > 0
    assert te.kernel_max_pages == cal.kernel_max_pages == kernel_max_pages(cal.kernel, cal.dma, 256)
    l2.page_buffer.view(torch.int16).random_(1, 1000)
    for n in (4, 100):
        tr = te.h2d_layerwise(list(range(n)), list(range(60, 60 + n)))
        te.wait_blocking(tr)
        assert not tr.fail
        assert torch.equal(l1.kv[:, :, 60:60 + n].cpu(), l2.page_buffer[:n].permute(1, 2, 0, 3, 4, 5))
        assert te.layer_flags.flags.tolist() == [tr.epoch] * 36
    te.close()

"""GPU-only checks of the transfer engine (skipped without CUDA): layer-ordered restores and their
flags, the copy kernels that reach pinned L2, pipelined chunks, how a transfer's time is split and
sampled, and failures that must not strand a forward. Engine-level GPU checks: tests/test_gpu.py."""
import random

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_one_token_pages_restore_by_the_copy_kernel_at_any_length():
    """Regression: with one-token pages (2 KiB slabs of the 8B shape) a restore longer than
    --hicache-kernel-restore-max-tokens took 2-D DMAs of 2 KiB rows (10-18 GiB/s on the H200), and
    the kernel moved one slab an item. Now such a restore takes the kernel at any length, 8 slabs an
    item, and lands byte for byte with every layer's flag at its epoch; a backup's first pages are
    gathered like the rest (no 2-D DMAs of 2 KiB rows)."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=1, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 1200, torch.device("cuda")), HostPool(geo, 1100, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "triton"), kernel_max_pages=0)
    assert te.narrow_slabs and te.direct_pages == 0 and te.host_copy.rows == 8
    l2.page_buffer.view(torch.int16).random_(1, 1000)
    host, dev = list(range(50, 1050)), random.Random(2).sample(range(1200), 1000)
    tr = te.h2d_layerwise(host, dev)
    assert tr is not None and tr.page_list is not None  # the kernel's page list, not a DMA plan
    te.wait_blocking(tr)
    assert not tr.fail
    assert torch.equal(l1.kv[:, :, dev].cpu(), l2.buffer[:, :, host])
    assert te.layer_flags.flags.tolist() == [tr.epoch] * 36
    l2.page_buffer.zero_()
    tr = te.d2h(dev[:500], list(range(500)))
    te.wait_blocking(tr)
    assert torch.equal(l2.buffer[:, :, :500], l1.kv[:, :, dev[:500]].cpu())
    te.close()


@pytest.mark.parametrize("captured,fragmented,whole", [(True, False, 0), (False, False, 0), (True, True, 0),
                                                      (False, True, 0), (True, False, 112), (False, False, 112)])
def test_layer_flags_hold_each_layer_until_its_copy_landed(captured, fragmented, whole):
    """A layer-ordered restore of 288 MiB (several ms over PCIe) and, right behind it, work that
    reads each layer after waiting for that layer's flag (inside a captured graph, with the epoch
    staged in a device tensor; or eagerly): every layer it reads is the restored data, none the
    zeros that were there before, and no wait gives up. Fragmented: pages in random order on both
    sides, too many runs for the 2-D DMA plan, so the copy kernel reading pinned L2 moves them.
    Whole: the first 112 pages go whole (DMA + scatter) before layer 0; layer 0's flag covers them."""
    from hicache.geometry import KVGeometry
    from hicache.layer_copy import layer_plan
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    n = 128
    l1 = DevicePool(geo, n + 8, torch.device("cuda"))
    l2 = HostPool(geo, n, pin=True)
    l2.page_buffer.view(torch.int16).random_(1, 1000)  # no zero anywhere
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"))
    assert te.layerwise
    flags = te.layer_flags
    l1_pages, host_pages = list(range(4, 4 + n)), list(range(n))
    if fragmented:
        rng = random.Random(2)
        l1_pages, host_pages = rng.sample(range(n + 8), n), rng.sample(range(n), n)
    assert (layer_plan(geo, n + 8, l1_pages, host_pages) is None) == fragmented
    idx = torch.tensor(l1_pages, device="cuda")
    seen = torch.empty((geo.num_layers, 2, n, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    staged = torch.zeros(1, dtype=torch.int64, device="cuda")

    def read_layers():
        for layer in range(geo.num_layers):
            flags.wait(layer, staged)
            seen[layer].copy_(l1.kv[:, layer].index_select(1, idx))

    graph = None
    if captured:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            read_layers()  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            read_layers()
    for _ in range(3):
        l1.kv.zero_()
        seen.zero_()
        tr = te.h2d_layerwise(host_pages, l1_pages, whole_pages=whole)
        assert (tr.workspace is not None) == bool(whole)  # the whole pages' staging
        staged.fill_(tr.epoch)
        graph.replay() if captured else read_layers()
        torch.cuda.synchronize()
        te.wait_blocking(tr)
        want = l2.buffer[:, :, host_pages].permute(1, 0, 2, 3, 4, 5).cuda()  # [L, 2, n, S, H, D]
        assert torch.equal(seen, want)
        assert not flags.timed_out()
    te.close()


def test_fragmented_transfers_reach_pinned_l2_with_the_copy_kernels():
    """A plain (not layer-ordered) H2D of host pages in random order takes the copy kernel, not a
    CPU gather, and lands byte for byte; twice in a row (the kernel's counts reset). A D2H into
    host pages in random order writes them straight (no workspace), byte for byte."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    l1 = DevicePool(geo, 80, torch.device("cuda"))
    l2 = HostPool(geo, 64, pin=True)
    l2.page_buffer.view(torch.int16).random_(1, 1000)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"))
    assert te.host_reads
    rng = random.Random(3)
    for _ in range(2):
        l1.kv.zero_()
        host_pages, l1_pages = rng.sample(range(64), 40), rng.sample(range(80), 40)
        tr = te.h2d(host_pages, l1_pages)
        assert tr.workspace is None  # no staging: the kernel reads L2 directly
        te.wait_blocking(tr)
        assert torch.equal(l1.kv[:, :, l1_pages].cpu(), l2.buffer[:, :, host_pages])
        untouched = sorted(set(range(80)) - set(l1_pages))
        assert not l1.kv[:, :, untouched].any()
    l1.kv.view(torch.int16).random_(1, 1000)
    l2.page_buffer.zero_()
    host_pages, l1_pages = rng.sample(range(64), 40), rng.sample(range(80), 40)
    tr = te.d2h(l1_pages, host_pages)
    assert tr.workspace is None and tr.finish is None
    te.wait_blocking(tr)
    assert torch.equal(l2.buffer[:, :, host_pages], l1.kv[:, :, l1_pages].cpu())
    assert not l2.page_buffer[sorted(set(range(64)) - set(host_pages))].any()
    te.close()


@pytest.mark.parametrize("kind", ["pipelined", "whole", "layerwise", "kernel"])
def test_a_transfer_behind_a_busy_callers_stream_counts_that_wait_apart(kind):
    """Enqueued while a ~50 ms kernel still runs on the caller's stream, every kind of transfer
    waits for it; the wait is measured as compute_wait_ns (on the device clock, from enqueue to the
    caller's work done) and left out of its recurring time, which stays about its own service."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 64, torch.device("cuda")), HostPool(geo, 64, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"), kernel_max_pages=8 if kind == "kernel" else 0,
                        min_dma_row_bytes=0)  # 4 KiB slabs: 2-D DMAs all the same
    pages = {"pipelined": 16, "whole": 4, "layerwise": 16, "kernel": 4}[kind]
    host, dev = list(range(pages)), list(range(10, 10 + pages))
    enqueue = te.h2d_layerwise if kind in ("layerwise", "kernel") else te.h2d
    te.wait_blocking(enqueue(host, dev))  # warm: compile, workspaces
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms on the caller's (current) stream
    tr = te.wait_blocking(enqueue(host, dev))
    assert tr.compute_wait_ns > 20_000_000
    assert tr.recurring_ns + tr.compute_wait_ns <= tr.end_to_end_ns - tr.setup_ns
    assert tr.recurring_ns < tr.compute_wait_ns / 2
    te.close()


@pytest.mark.parametrize("kind", ["pipelined", "layerwise", "kernel"])
def test_a_transfer_seen_done_late_is_sampled_by_its_device_time(kind):
    """Regression (session 17): a restore whose completion a thread saw ~100 ms late was sampled
    as a 100 ms copy. Seen 50 ms after the device finished, a transfer's recurring time stays its
    device time; the 50 ms are its seen_wait_ns."""
    import time

    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 64, torch.device("cuda")), HostPool(geo, 64, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"), kernel_max_pages=8 if kind == "kernel" else 0,
                        min_dma_row_bytes=0)
    pages = {"pipelined": 16, "layerwise": 16, "kernel": 4}[kind]
    host, dev = list(range(pages)), list(range(10, 10 + pages))
    enqueue = te.h2d_layerwise if kind in ("layerwise", "kernel") else te.h2d
    te.wait_blocking(enqueue(host, dev))  # warm: compile, workspaces
    tr = enqueue(host, dev)
    torch.cuda.synchronize()
    time.sleep(0.05)
    te.wait_blocking(tr)
    assert tr.device_ns > 0 and tr.seen_wait_ns > 40_000_000
    assert tr.recurring_ns < 20_000_000
    te.close()


def test_a_copy_kernel_that_cannot_launch_fails_the_transfer_with_every_flag_written(monkeypatch):
    """A short restore goes by the copy kernel; if its launch raises, the transfer fails (not the
    caller) and every layer flag still reaches the epoch, so no forward waits for it."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine, TransferError
    from kernels import host_copy
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 16, torch.device("cuda")), HostPool(geo, 16, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"), kernel_max_pages=8)

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(host_copy.HostCopy, "h2d_layers", broken)
    tr = te.h2d_layerwise([0, 1, 2], [5, 6, 7])
    assert tr is not None and tr.fail
    with pytest.raises(TransferError, match="copy kernel not launched"):
        te.wait_blocking(tr)
    assert te.layer_flags.flags.tolist() == [tr.epoch] * 4
    te.close()


def test_layer_wait_gives_up_on_a_flag_never_written():
    """A wait for an epoch no copy will write returns after its spins and reports it."""
    from kernels.layer_flags import LayerFlags

    flags = LayerFlags(2, torch.device("cuda"), max_spins=1000)
    flags.signal(torch.cuda.current_stream(), 0, 5)
    flags.expected.fill_(5)
    flags.wait(0)
    assert not flags.timed_out()
    flags.expected.fill_(6)
    flags.wait(1)
    assert flags.timed_out()


def _compiled_variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return sum(len(c) for c in getattr(kernel, "cache", {}).values())
    return sum(len(v[0] if isinstance(v, tuple) else v) for v in caches.values())


def test_page_copy_compiles_once_for_every_chunk():
    """Transfers are cut in chunks of any length starting at any page: after the first launch no
    chunk may compile another kernel variant (a mid-serving compile stalls a restore ~0.1 s)."""
    from kernels.page_copy import _page_copy_kernel, gather_pages_triton, scatter_pages_triton

    pool = torch.randn((2, 4, 40, 16, 8, 128), device="cuda").to(torch.bfloat16)
    idx = torch.randperm(40, device="cuda")
    packed = torch.empty((40, 2, 4, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    gather_pages_triton(pool, idx[:2], packed[:2])
    scatter_pages_triton(packed[:2], idx[:2], pool)
    before = _compiled_variants(_page_copy_kernel)
    for lo, hi in [(1, 4), (3, 16), (5, 6), (7, 40), (0, 33)]:
        gather_pages_triton(pool, idx[lo:hi], packed[lo:hi])
        scatter_pages_triton(packed[lo:hi], idx[lo:hi], pool)
    small = torch.randn((2, 4, 7, 16, 8, 128), device="cuda").to(torch.bfloat16)  # another pool size
    gather_pages_triton(small, idx[:3] % 7, packed[:3])
    torch.cuda.synchronize()
    assert _compiled_variants(_page_copy_kernel) == before


@pytest.mark.parametrize("backend,direct,raw_dma", [("triton", 3, True), ("torch", 3, True), ("triton", 0, True),
                                                    ("triton", 0, False)])
def test_pipelined_transfers_move_every_chunk_exactly(backend, direct, raw_dma):
    """Consecutive L2 pages go by the chunked pipeline (kernels on explicit streams, one raw DMA a
    chunk): with a 2-page first chunk, 40 pages in random L1 order are 3 chunks each way, a D2H's
    first 3 pages going straight out of L1 by 2-D DMAs (then 2 gathered chunks), or none (3
    gathered chunks, as at one-token pages). D2H then H2D land byte for byte, twice (the second
    time through the cached direct launches); also without the runtime's raw copies (torch's
    copies instead)."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from hicache.transfer_plan import RAMP_GROWTH, ramp_chunks
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 96, torch.device("cuda")), HostPool(geo, 64, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, backend), min_dma_row_bytes=0)  # 4 KiB slabs
    te.first_chunk_pages = 2
    assert te.direct_pages > 0  # pinned L2 and the runtime's 2-D copy
    te.direct_pages = direct
    if not raw_dma:
        te._memcpy = None
    assert len(ramp_chunks(40, 2, RAMP_GROWTH)) == 3 and len(ramp_chunks(37, 6, RAMP_GROWTH)) == 2
    rng = random.Random(5)
    for _ in range(2):
        l1.kv.view(torch.int16).random_(1, 1000)
        l2.page_buffer.zero_()
        src, host_pages = rng.sample(range(96), 40), list(range(10, 50))
        tr = te.d2h(src, host_pages)
        assert tr.workspace is not None  # the gather + DMA pipeline, not a copy kernel
        te.wait_blocking(tr)
        assert torch.equal(l2.buffer[:, :, host_pages], l1.kv[:, :, src].cpu())
        assert not l2.page_buffer[:10].any() and not l2.page_buffer[50:].any()
        dst = rng.sample(range(96), 40)
        l1.kv.zero_()
        te.wait_blocking(te.h2d(host_pages, dst))
        assert torch.equal(l1.kv[:, :, dst].cpu(), l2.buffer[:, :, host_pages])
        assert not l1.kv[:, :, sorted(set(range(96)) - set(dst))].any()
    te.close()


@pytest.mark.parametrize("pending", ["write", "read"])
def test_pipelined_h2d_into_a_fresh_workspace_waits_for_the_callers_last_use_of_its_memory(pending):
    """A pipelined H2D DMAs its first chunk into its workspace before anything waits on the caller's
    stream. A workspace allocated now comes from the caller's stream's pool, which may hand out a
    block that stream freed but still uses (a forward's temporaries, enqueued and not yet run):
    the DMA must land neither before that stream's last write of the block nor before its last read."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 64, torch.device("cuda")), HostPool(geo, 64, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"))
    l2.page_buffer.view(torch.int16).random_(1, 1000)  # no 3 or 7 (bf16) anywhere
    n = 16  # >= 8 consecutive L2 pages: the pipeline
    host, dev = list(range(n)), list(range(20, 20 + n))
    torch.cuda.synchronize()
    block = torch.full(geo.page_major_shape(n), 7, dtype=geo.dtype, device="cuda")
    torch.cuda._sleep(100_000_000)  # ~50 ms: the caller's stream is busy, as under a forward
    if pending == "write":
        block.fill_(3)              # its last write of the block, still to run
    seen = block.clone()            # its last read of the block, still to run
    del block                       # freed: the allocator may hand it out again on this stream
    tr = te.h2d(host, dev)
    assert tr.workspace is not None  # the pipeline, with a workspace allocated just now
    te.wait_blocking(tr)
    torch.cuda.synchronize()
    assert torch.equal(seen, torch.full_like(seen, 3 if pending == "write" else 7))  # caller's read intact
    assert torch.equal(l1.kv[:, :, dev].cpu(), l2.buffer[:, :, host])  # restore is L2's bytes
    te.close()


def test_a_whole_part_that_fails_midway_completes_after_its_queued_scatters():
    """Regression (session 21 review): a layer-ordered restore whose whole part raised after a
    scatter was queued wrote every flag and completed on the layer stream alone, so its workspace
    was given back (and its L1 pages freed by the failed op) while that scatter still ran. The
    transfer now completes only once the layer kernel stream is past what was enqueued."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from hicache.transfer_record import TransferError
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 120, torch.device("cuda")), HostPool(geo, 110, pin=True)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "triton"), kernel_max_pages=0)
    real, calls = te._dma, []

    def second_dma_raises(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("DMA refused")
        real(*args)

    te._dma = second_dma_raises
    with torch.cuda.stream(te.layer_kernel_stream):
        torch.cuda._sleep(int(2e8))  # the scatters queue behind it; the copies and flags do not
    tr = te.h2d_layerwise(list(range(100)), list(range(10, 110)), whole_pages=80)
    with pytest.raises(TransferError, match="not copied"):
        te.wait_blocking(tr)
    assert te.layer_kernel_stream.query()  # nothing of the transfer still runs once it completed
    assert te.layer_flags.flags.tolist() == [tr.epoch] * 4
    te.close()


def test_only_a_restore_a_forward_waits_beside_takes_the_wide_copy_kernel():
    """Session 26: a layer-ordered restore by the copy kernel launches `beside_forward_programs`
    (its forward waits for it as it lands); the classic H2D of fragmented L2 pages (nothing runs
    beside it but other requests' decode) and a fragmented backup keep BACKGROUND_PROGRAMS. The
    grids are recorded at the launch; the copies still land."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels import host_copy
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    l1, l2 = DevicePool(geo, 256, torch.device("cuda")), HostPool(geo, 256, pin=True)
    l2.page_buffer.copy_(torch.randn(l2.page_buffer.shape).to(l2.page_buffer.dtype))
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"), kernel_max_pages=64)
    launched, run = [], te.host_copy._run

    def record(kernel, grid, stream, *args):
        launched.append((kernel, grid))
        run(kernel, grid, stream, *args)
    te.host_copy._run = record
    wide = host_copy.beside_forward_programs(torch.cuda.get_device_properties(0).multi_processor_count)
    te.wait_blocking(te.h2d_layerwise(list(range(32)), list(range(100, 132))))  # layer-ordered, short
    fragmented = list(range(0, 96, 3))  # 32 runs: more than the DMA plans take
    te.wait_blocking(te.h2d(fragmented, list(range(200, 232))))
    assert torch.equal(l1.kv[:, :, 100:132].cpu(), l2.page_buffer[:32].permute(1, 2, 0, 3, 4, 5))
    assert torch.equal(l1.kv[:, :, 200:232].cpu(), l2.page_buffer[fragmented].permute(1, 2, 0, 3, 4, 5))
    te.wait_blocking(te.d2h(list(range(100, 132)), list(range(1, 96, 3))))  # a fragmented backup
    assert torch.equal(l2.page_buffer[1:96:3], l1.kv[:, :, 100:132].cpu().permute(2, 0, 1, 3, 4, 5))
    assert [grid for _, grid in launched] == [(wide,), (host_copy.BACKGROUND_PROGRAMS,),
                                              (host_copy.BACKGROUND_PROGRAMS,)]
    te.close()


def test_l2_is_pinned_at_its_exact_size_outside_torchs_host_allocator():
    """Regression: L2 came from torch's caching host allocator, which pinned it on one thread (41.7 s
    for 64 GiB on the H200's host) and rounded it up to a power of two (40 GiB pinned 64 GiB). Now
    its exact bytes are registered (hicache/pinned.py): pinned, nothing taken from torch's host
    allocator, unregistered when the pool goes (pools made again and again register again), and
    a DMA each way plus the copy kernel that reads L2 by its host address move it byte for byte."""
    import gc

    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo = KVGeometry(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    def host_allocator_bytes():
        stats = torch.cuda.host_memory_stats()
        held = {k: v for k, v in stats.items() if k.endswith("bytes.current")}
        assert held, f"torch's host allocator reports no byte counts: {sorted(stats)}"
        return held

    before = host_allocator_bytes()
    for _ in range(3):
        l2 = HostPool(geo, 100, pin=True)
        assert l2.page_buffer.is_pinned()
        assert host_allocator_bytes() == before
        del l2
        gc.collect()
    l1, l2 = DevicePool(geo, 64, torch.device("cuda")), HostPool(geo, 64, pin=True)
    l2.page_buffer.view(torch.int16).random_(1, 1000)
    dev = l2.page_buffer.to("cuda", non_blocking=True)
    back = torch.empty_like(l2.page_buffer, pin_memory=True)
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, l2.page_buffer)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "triton"), kernel_max_pages=64)
    host, pages = [5, 9, 2, 40, 33, 17], [60, 3, 8, 21, 0, 44]   # fragmented: the copy kernel
    tr = te.h2d_layerwise(host, pages)
    te.wait_blocking(tr)
    assert not tr.fail
    assert torch.equal(l1.kv[:, :, pages].cpu(), l2.buffer[:, :, host])
    te.close()

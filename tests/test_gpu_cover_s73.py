"""GPU-only (skipped without CUDA): behaviours of the transfer engine's GPU paths that neither the CPU suite nor
the other GPU tests ran, found by session 73's merged CPU + GPU branch coverage. A transfer whose DMA raises
part-way through the pipeline (each direction) fails, completes only behind what it had enqueued, gives its
workspace back, and the same pages then move byte for byte; an injected failure of a copy-kernel transfer
settles and the next one lands; a D2H of exactly `direct_pages` pages goes wholly by 2-D DMAs out of L1; a
layer-ordered restore whose pages past `whole_pages` are too fragmented goes all by the copy kernel; the layer
flags start again from epoch 1 at EPOCH_LIMIT and forwards still wait for the copies; a refused stream write
falls back to cuMemsetD32Async; a refused cudaMemcpy2DAsync raises naming the call and its code. Two regressions:
a refused runtime call (a 2-D DMA, L2's cudaHostRegister) left its error as the thread's last error, which the next
torch kernel launch raised as its own."""
import random
import re

import pytest
import torch

pytestmark = pytest.mark.gpu


def _pools(slab_kib: int = 4, l1_pages: int = 64, l2_pages: int = 64):
    """(geometry, L1, pinned L2) of 4 layers, 16-token bf16 pages: 4 KiB slabs (32 KiB pages; too narrow for
    2-D DMAs unless min_dma_row_bytes=0) or 32 KiB slabs (256 KiB pages; 2-D DMAs at the default)."""
    from hicache.geometry import KVGeometry
    from hicache.pools import DevicePool, HostPool

    heads, dim = {4: (2, 64), 32: (8, 128)}[slab_kib]
    geo = KVGeometry(num_layers=4, num_kv_heads=heads, head_dim=dim, page_size=16, dtype=torch.bfloat16)
    return geo, DevicePool(geo, l1_pages, torch.device("cuda")), HostPool(geo, l2_pages, pin=True)


def _dma_raising_on_call(te, k: int, calls: list):
    """A stand-in for `te._dma` that raises on its k-th call and moves the chunk otherwise."""
    real = te._dma

    def dma(*args):
        calls.append(1)
        if len(calls) == k:
            raise RuntimeError("DMA refused")
        real(*args)
    return dma


def test_a_pipelined_h2d_whose_second_dma_raises_completes_behind_its_queued_scatter_and_the_retry_lands():
    """transfer.py `_not_enqueued` on CUDA, H2D: 16 consecutive L2 pages with a 2-page first chunk are DMA'd
    in chunks of 14 then 2; the second DMA raises after the first chunk's scatter was queued (behind ~100 ms
    of other work on the H2D kernel stream). The transfer fails with "not enqueued", completes only once that
    scatter ran (the copy stream waits for the kernel stream), gives its workspace back, and the same pages
    on the same engine then land byte for byte."""
    from hicache.transfer import TransferEngine, TransferError
    from kernels.chooser import choose_backends

    _, l1, l2 = _pools()
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"), min_dma_row_bytes=0)
    te.first_chunk_pages = 2
    l2.page_buffer.view(torch.int16).random_(1, 1000)  # no zero anywhere
    host, dev = list(range(16)), random.Random(7).sample(range(64), 16)
    real, calls = te._dma, []
    te._dma = _dma_raising_on_call(te, 2, calls)
    kernel_stream = te.kernel_streams["h2d"]
    with torch.cuda.stream(kernel_stream):
        torch.cuda._sleep(int(2e8))  # the first chunk's scatter queues behind it
    tr = te.h2d(host, dev)
    assert tr.fail and len(calls) == 2 and tr.workspace is not None  # the pipeline, failed at its 2nd DMA
    with pytest.raises(TransferError, match="h2d: not enqueued: .*DMA refused"):
        te.wait_blocking(tr)
    assert kernel_stream.query()  # nothing it enqueued still runs once it completed
    assert tr.workspace is None and not any(w.busy for w in te.workspaces)
    te._dma = real
    l1.kv.zero_()
    tr = te.wait_blocking(te.h2d(host, dev))
    assert not tr.fail and not any(w.busy for w in te.workspaces)
    assert torch.equal(l1.kv[:, :, dev].cpu(), l2.buffer[:, :, host])
    assert not l1.kv[:, :, sorted(set(range(64)) - set(dev))].any()
    te.close()


def test_a_pipelined_d2h_whose_second_dma_raises_fails_gives_its_workspace_back_and_the_retry_lands():
    """transfer.py `_not_enqueued` on CUDA, D2H: 16 L1 pages in random order into 16 consecutive L2 pages,
    2 straight out of L1 by 2-D DMAs, then gathered chunks of 4 and 10; the second chunk's DMA raises. The
    transfer fails with "not enqueued", settles (its workspace free), and the same pages then reach L2
    byte for byte, the L2 pages around them untouched."""
    from hicache.transfer import TransferEngine, TransferError
    from hicache.transfer_plan import gathered_chunks
    from kernels.chooser import choose_backends

    _, l1, l2 = _pools()
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"), min_dma_row_bytes=0)
    assert te.direct_pages == 8  # 4 KiB slabs allowed 2-D DMAs: a D2H's first pages go straight out of L1
    te.first_chunk_pages, te.direct_pages = 2, 2
    assert gathered_chunks(14, 2, 2) == [4, 10]
    l1.kv.view(torch.int16).random_(1, 1000)
    src, host = random.Random(8).sample(range(64), 16), list(range(10, 26))
    real, calls = te._dma, []
    te._dma = _dma_raising_on_call(te, 2, calls)
    tr = te.d2h(src, host)
    assert tr.fail and len(calls) == 2 and tr.workspace is not None
    with pytest.raises(TransferError, match="d2h: not enqueued: .*DMA refused"):
        te.wait_blocking(tr)
    assert tr.workspace is None and not any(w.busy for w in te.workspaces)
    te._dma = real
    l2.page_buffer.zero_()
    tr = te.wait_blocking(te.d2h(src, host))
    assert not tr.fail and not any(w.busy for w in te.workspaces)
    assert torch.equal(l2.buffer[:, :, host], l1.kv[:, :, src].cpu())
    assert not l2.page_buffer[:10].any() and not l2.page_buffer[26:].any()
    te.close()


def test_an_injected_failure_of_a_copy_kernel_transfer_settles_it_and_the_next_one_lands():
    """transfer.py `_kernel_transfer`'s Fault.TRANSFER_RAISE on CUDA, each direction: 40 pages in random
    order on both sides (more L2 runs than DMAs take) go by the copy kernel that reaches pinned L2. With the
    fault armed once, the transfer fails on wait ("injected transfer failure") yet is settled: its pinned
    page list is given back (the next transfer reuses it), and an H2D's kernel still ran to the end (its
    flags at the epoch, its per-layer counts reset). The next transfer, the fault spent, lands byte for byte."""
    from hicache.faults import Fault, FaultInjector
    from hicache.transfer import TransferEngine, TransferError
    from kernels.chooser import choose_backends

    geo, l1, l2 = _pools(l1_pages=80)
    faults = FaultInjector()
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"), faults=faults)
    assert te.host_reads
    rng = random.Random(11)
    l2.page_buffer.view(torch.int16).random_(1, 1000)
    for fired, direction in enumerate(("h2d", "d2h"), start=1):
        faults.arm(Fault.TRANSFER_RAISE, times=1)
        host, dev = rng.sample(range(64), 40), rng.sample(range(80), 40)
        tr = te.h2d(host, dev) if direction == "h2d" else te.d2h(dev, host)
        assert tr.fail and tr.workspace is None and tr.page_list is not None  # the copy kernel's transfer
        page_list = tr.page_list
        with pytest.raises(TransferError, match=f"{direction}: injected transfer failure"):
            te.wait_blocking(tr)
        assert faults.fired[Fault.TRANSFER_RAISE] == fired and tr.page_list is None
        if direction == "h2d":
            assert te._h2d_flags.tolist() == [tr.epoch] * geo.num_layers
            assert not te._counts["h2d"].any()
        host, dev = rng.sample(range(64), 40), rng.sample(range(80), 40)
        if direction == "h2d":
            l1.kv.zero_()
            tr = te.h2d(host, dev)
        else:
            l1.kv.view(torch.int16).random_(1, 1000)
            l2.page_buffer.zero_()
            tr = te.d2h(dev, host)
        assert tr.page_list is page_list  # given back at the failure, reused now
        te.wait_blocking(tr)
        assert not tr.fail
        if direction == "h2d":
            assert torch.equal(l1.kv[:, :, dev].cpu(), l2.buffer[:, :, host])
            assert not l1.kv[:, :, sorted(set(range(80)) - set(dev))].any()
        else:
            assert torch.equal(l2.buffer[:, :, host], l1.kv[:, :, dev].cpu())
            assert not l2.page_buffer[sorted(set(range(64)) - set(host))].any()
    te.close()


def test_a_pipelined_d2h_of_only_direct_pages_is_all_2d_dmas_out_of_l1_byte_for_byte(monkeypatch):
    """transfer.py `_pipelined`'s `direct == n`: a D2H of exactly `direct_pages` (DIRECT_MAX_PAGES = 8 for
    these 256 KiB pages) L1 pages in random order into consecutive L2 pages is pipelined, but every page
    goes by its own 2-D DMA straight out of L1: no gather kernel and no chunk DMA run, and the L2 pages
    equal the L1 pages byte for byte (random data), those around them untouched; twice (the workspace
    reused)."""
    import hicache.transfer as transfer
    from hicache.transfer import TransferEngine
    from hicache.transfer_plan import DIRECT_MAX_PAGES
    from kernels.chooser import choose_backends

    _, l1, l2 = _pools(slab_kib=32, l1_pages=24, l2_pages=16)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"))
    assert not te.narrow_slabs and te.direct_pages == DIRECT_MAX_PAGES == 8
    gathers, dmas = [], []
    real_gather, real_dma = transfer.gather_pages, te._dma
    monkeypatch.setattr(transfer, "gather_pages", lambda *a, **k: (gathers.append(1), real_gather(*a, **k)))
    te._dma = lambda *a: (dmas.append(1), real_dma(*a))
    rng = random.Random(13)
    host = list(range(4, 12))
    for _ in range(2):
        l1.kv.view(torch.int16).random_(1, 1000)
        l2.page_buffer.zero_()
        src = rng.sample(range(24), 8)
        assert any(b != a + 1 for a, b in zip(src, src[1:]))  # not one L1 run
        tr = te.d2h(src, host)
        assert tr.workspace is not None and not tr.fail  # the pipeline (8 pages, one L2 run), not a copy kernel
        te.wait_blocking(tr)
        assert torch.equal(l2.buffer[:, :, host], l1.kv[:, :, src].cpu())
        assert not l2.page_buffer[:4].any() and not l2.page_buffer[12:].any()
        assert not any(w.busy for w in te.workspaces)
    assert gathers == [] and dmas == []
    te.close()


def test_a_layer_ordered_restore_whose_rest_is_too_fragmented_for_the_dma_plan_goes_all_by_the_copy_kernel():
    """transfer_layered.py `h2d_layerwise`, whole_pages > 0 whose first 16 pages are consecutive in L2 but
    whose other 24 are in too many runs for the 2-D DMA plan: nothing goes whole (no workspace, no scatter);
    the whole restore is one copy-kernel launch over its 40 pages, landing byte for byte with every layer
    flag at the restore's epoch."""
    from hicache.layer_copy import layer_plan
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends

    geo, l1, l2 = _pools(slab_kib=32)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"))
    assert te.layerwise and te.host_reads and not te.narrow_slabs and te.kernel_max_pages == 0  # not "short"
    l2.page_buffer.view(torch.int16).random_(1, 1000)
    rng = random.Random(17)
    host, dev = list(range(16)) + rng.sample(range(16, 64), 24), rng.sample(range(64), 40)
    assert layer_plan(geo, 64, dev[16:], host[16:]) is None
    tr = te.h2d_layerwise(host, dev, whole_pages=16)
    assert tr is not None and not tr.fail
    assert tr.workspace is None and tr.page_list is not None  # no whole part staged: the kernel's page list
    assert tr.page_list[:80].view(2, 40).tolist() == [host, dev]  # all 40 pages, in the given order
    te.wait_blocking(tr)
    assert len(te.workspaces) == 0
    assert torch.equal(l1.kv[:, :, dev].cpu(), l2.buffer[:, :, host])
    assert not l1.kv[:, :, sorted(set(range(64)) - set(dev))].any()
    assert te.layer_flags.flags.tolist() == [tr.epoch] * geo.num_layers
    te.close()


def test_layer_flags_start_again_from_epoch_1_at_the_limit_and_forwards_still_wait_for_each_layer(monkeypatch):
    """kernels/layer_flags.py `next_epoch` at EPOCH_LIMIT on CUDA: after a restore at the limit (flags at
    EPOCH_LIMIT) the next restore's epoch is 1 and the flags were zeroed first. Its copies held ~50 ms on
    the layer stream, work that waits eagerly for each layer's flag before reading it sees the restored
    data (not the zeros there before: flags left at EPOCH_LIMIT would release every wait at once), no wait
    gives up, and the flags end at epoch 1."""
    from hicache.layer_copy import layer_plan
    from hicache.transfer import TransferEngine
    from kernels.chooser import choose_backends
    from kernels.layer_flags import EPOCH_LIMIT

    geo, l1, l2 = _pools(slab_kib=32, l1_pages=24, l2_pages=16)
    te = TransferEngine(l1, l2, choose_backends(l1.kv, "torch"))
    flags, n = te.layer_flags, 16
    l2.page_buffer.view(torch.int16).random_(1, 1000)  # no zero anywhere
    host, dev = list(range(n)), list(range(4, 4 + n))
    assert layer_plan(geo, 24, dev, host) is not None  # the 2-D DMA plan, not the kernel
    te.wait_blocking(te.h2d_layerwise(host, dev))
    flags.flags.fill_(EPOCH_LIMIT)  # as a restore at the limit left them
    flags.epoch = EPOCH_LIMIT
    real = flags.next_epoch

    def then_hold_the_copies():
        epoch = real()
        with torch.cuda.stream(te.layer_stream):
            torch.cuda._sleep(int(1e8))  # ~50 ms before the copies (enqueued after this returns)
        return epoch
    monkeypatch.setattr(flags, "next_epoch", then_hold_the_copies)
    idx = torch.tensor(dev, device="cuda")
    seen = torch.zeros((geo.num_layers, 2, n, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    l1.kv.zero_()
    tr = te.h2d_layerwise(host, dev)
    assert tr.epoch == 1 and flags.epoch == 1
    flags.expected.fill_(tr.epoch)
    for layer in range(geo.num_layers):
        flags.wait(layer)
        seen[layer].copy_(l1.kv[:, layer].index_select(1, idx))
    torch.cuda.synchronize()
    te.wait_blocking(tr)
    assert not tr.fail
    assert torch.equal(seen, l2.buffer[:, :, host].permute(1, 0, 2, 3, 4, 5).cuda())
    assert not flags.timed_out()
    assert flags.flags.tolist() == [1] * geo.num_layers
    te.close()


def test_a_refused_stream_write_falls_back_to_memset_for_good():
    """kernels/layer_flags.py `signal`: when cuStreamWriteValue32 returns an error, the flag is written by
    cuMemsetD32Async in stream order and the stream write is never tried again (`_write` None); a later
    signal still lands. A memset that is refused raises RuntimeError naming cuMemsetD32Async."""
    from kernels.layer_flags import LayerFlags

    flags = LayerFlags(2, torch.device("cuda"))
    assert flags._write is not None  # stream memory operations on: the path under test is the fallback
    stream, calls = torch.cuda.Stream(), []
    flags._write = lambda *args: (calls.append(args), 1)[1]  # CUDA_ERROR_INVALID_VALUE
    flags.signal(stream, 1, 7)
    stream.synchronize()
    assert calls == [(stream.cuda_stream, flags.flags.data_ptr() + 4, 7, 0)]
    assert flags._write is None and flags.flags.tolist() == [0, 7]
    flags.signal(stream, 0, 9)
    stream.synchronize()
    assert flags.flags.tolist() == [9, 7] and len(calls) == 1
    flags._memset = lambda *args: 1
    with pytest.raises(RuntimeError, match="cuMemsetD32Async failed with CUDA error 1"):
        flags.signal(stream, 0, 11)
    stream.synchronize()
    assert flags.flags.tolist() == [9, 7]


def test_a_2d_copy_the_runtime_refuses_raises_naming_the_call_and_its_code():
    """kernels/cuda_rt.py `memcpy_2d_async` / `_check`: of two 2-D copies, the first is enqueued and lands;
    the second, rows wider than their pitch, is refused by cudaMemcpy2DAsync (cudaErrorInvalidPitchValue,
    12; or cudaErrorInvalidValue, 1), which raises RuntimeError naming the call and the code, with nothing
    of it copied. The context is not poisoned: the device runs work after it."""
    from kernels import cuda_rt

    assert cuda_rt.available()
    stream = torch.cuda.Stream()
    src = torch.arange(1, 513, dtype=torch.int32).pin_memory()  # 2 KiB, no zero
    dst = torch.zeros(512, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    ok = (dst.data_ptr(), 1024, src.data_ptr(), 1024, 1024, 1)  # the first KiB, one row
    refused = (dst.data_ptr() + 1024, 128, src.data_ptr() + 1024, 128, 256, 4)  # 256-byte rows 128 bytes apart
    with pytest.raises(RuntimeError, match=r"cudaMemcpy2DAsync failed with CUDA error \d+") as info:
        cuda_rt.memcpy_2d_async([ok, refused], stream)
    assert int(re.search(r"CUDA error (\d+)", str(info.value)).group(1)) in (1, 12)
    stream.synchronize()
    assert torch.equal(dst[:256].cpu(), src[:256])
    assert not dst[256:].any()
    assert (dst[:4] + 1).tolist() == [2, 3, 4, 5]


def test_a_refused_2d_copy_leaves_no_stale_error_for_the_next_torch_kernel():
    """After memcpy_2d_async raised for a copy the runtime refused, the next torch kernel launched on the
    same thread runs: the engine treats the transfer as failed and serves on, so a forward launched next
    must not fail with the refused copy's error. Regression: cuda_rt._check raised but left the error as the
    runtime's last error of the thread, which the next ATen kernel launch (its cudaGetLastError check)
    raised as its own."""
    from kernels import cuda_rt

    stream = torch.cuda.Stream()
    src = torch.zeros(256, dtype=torch.int32).pin_memory()
    dst = torch.zeros(256, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="cudaMemcpy2DAsync"):
        cuda_rt.memcpy_2d_async([(dst.data_ptr(), 128, src.data_ptr(), 128, 256, 2)], stream)
    try:
        assert (dst + 1).sum().item() == 256  # an elementwise kernel: its launch checks cudaGetLastError()
    finally:
        cuda_rt._lib().cudaGetLastError()  # (without the fix: leave no error to the tests after this one)


def test_a_refused_host_register_falls_back_and_leaves_no_stale_error_for_the_next_kernel(monkeypatch):
    """hicache/pinned.py: where the runtime refuses to register L2's memory (here: the same bytes twice,
    cudaErrorHostMemoryAlreadyRegistered), L2 falls back to torch's pinned allocator, and the next torch kernel
    launched on the thread runs. Regression: the refused cudaHostRegister stayed the runtime's last error of the
    thread, and the first kernel after (the engine's first forward) raised it as its own."""
    import hicache.pinned as pinned
    from kernels import cuda_rt

    class Owner:
        pass

    owner = Owner()
    first = pinned.pinned_zeros(owner, (1 << 20,), torch.uint8)  # registered by cudaHostRegister
    monkeypatch.setattr(pinned, "_huge_page_zeros", lambda num_bytes: first[:num_bytes])  # the same bytes again
    try:
        again = pinned.pinned_zeros(Owner(), (1 << 20,), torch.uint8)
        assert again.is_pinned() and again.data_ptr() != first.data_ptr()  # torch's pinned allocator's
        assert (torch.ones(4, device="cuda") + 1).sum().item() == 8  # kernel launches: they check cudaGetLastError()
    finally:
        cuda_rt._lib().cudaGetLastError()  # (without the fix: leave no error to the tests after this one)
    del owner

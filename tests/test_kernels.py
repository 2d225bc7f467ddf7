"""Page gather/scatter kernels (Triton under the interpreter, torch reference) and the backend chooser."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede importing triton / kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import chooser, page_copy  # noqa: E402

BACKENDS = ["triton", "torch"]
WORD = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def make_pool(layers: int, pool_pages: int, page_size: int, heads: int, head_dim: int,
              dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random-bits L1 pool [2, L, P, S, H, D] (every bit pattern, NaNs included: compare as ints)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, layers, pool_pages, page_size, heads, head_dim)
    word = WORD[dtype]
    info = torch.iinfo(word)
    return torch.randint(info.min, info.max, shape, dtype=word, generator=gen).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(WORD[t.dtype])


def reference_gather(l1: torch.Tensor, page_ids: list[int]) -> torch.Tensor:
    return torch.stack([l1[:, :, p] for p in page_ids])  # [n, 2, L, S, H, D]


CASES = [  # (page_size, dtype, n)
    (1, torch.float32, 1), (1, torch.bfloat16, 5), (4, torch.float32, 3),
    (4, torch.bfloat16, 1), (16, torch.float32, 6), (16, torch.bfloat16, 4),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size,dtype,n", CASES)
def test_gather_scatter_match_reference(backend, page_size, dtype, n):
    layers, pool_pages, heads, head_dim = 3, 9, 2, 8
    l1 = make_pool(layers, pool_pages, page_size, heads, head_dim, dtype, seed=page_size * 10 + n)
    gen = torch.Generator().manual_seed(n)
    ids = torch.randperm(pool_pages, generator=gen)[:n].tolist()  # random order, no repeats
    page_ids = torch.tensor(ids, dtype=torch.int64)
    # packed is the first n pages of a larger buffer, pre-filled with a sentinel
    buf = torch.full((n + 2, 2, layers, page_size, heads, head_dim), 7, dtype=dtype)
    packed = buf[:n]
    page_copy.gather_pages(l1, page_ids, packed, backend)
    assert torch.equal(bits(packed), bits(reference_gather(l1, ids)))
    assert torch.equal(bits(buf[n:]), bits(torch.full_like(buf[n:], 7)))  # tail untouched

    src = make_pool(layers, n, page_size, heads, head_dim, dtype, seed=99).permute(2, 0, 1, 3, 4, 5)
    src = src.contiguous()  # [n, 2, L, S, H, D]
    dst = l1.clone()
    page_copy.scatter_pages(src, page_ids, dst, backend)
    expected = l1.clone()
    for i, p in enumerate(ids):
        expected[:, :, p] = src[i]
    assert torch.equal(bits(dst), bits(expected))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size,heads,head_dim", [(3, 3, 5), (16, 2, 160), (1, 1, 4096)])
def test_odd_and_multi_chunk_slabs(backend, page_size, heads, head_dim):
    """Slabs that are not a power of two (masked chunk) or span several BLOCK chunks."""
    layers, pool_pages = 2, 5
    l1 = make_pool(layers, pool_pages, page_size, heads, head_dim, torch.float32, seed=head_dim)
    ids = [4, 1, 3]
    page_ids = torch.tensor(ids, dtype=torch.int64)
    packed = torch.empty((3, 2, layers, page_size, heads, head_dim))
    page_copy.gather_pages(l1, page_ids, packed, backend)
    assert torch.equal(bits(packed), bits(reference_gather(l1, ids)))
    dst = torch.zeros_like(l1)
    page_copy.scatter_pages(packed, page_ids, dst, backend)
    assert torch.equal(bits(dst[:, :, ids]), bits(l1[:, :, ids]))
    assert torch.equal(bits(dst[:, :, [0, 2]]), bits(torch.zeros_like(dst[:, :, [0, 2]])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_and_untouched_pages(backend):
    layers, pool_pages, page_size, heads, head_dim = 2, 12, 4, 2, 16
    l1 = make_pool(layers, pool_pages, page_size, heads, head_dim, torch.bfloat16, seed=3)
    original = l1.clone()
    page_ids = torch.tensor([7, 2, 11, 0, 5], dtype=torch.int64)
    packed = torch.empty((5, 2, layers, page_size, heads, head_dim), dtype=torch.bfloat16)
    page_copy.gather_pages(l1, page_ids, packed, backend)
    l1[:, :, page_ids] = 0  # wipe, then restore from packed
    page_copy.scatter_pages(packed, page_ids, l1, backend)
    assert torch.equal(bits(l1), bits(original))

    # scatter into a zero pool touches exactly the listed pages
    zero = torch.zeros_like(l1)
    page_copy.scatter_pages(packed, page_ids, zero, backend)
    outside = [p for p in range(pool_pages) if p not in page_ids.tolist()]
    assert torch.equal(bits(zero[:, :, outside]), bits(torch.zeros_like(zero[:, :, outside])))
    assert torch.equal(bits(zero[:, :, page_ids]), bits(original[:, :, page_ids]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_page_list_is_noop(backend):
    l1 = make_pool(1, 3, 2, 1, 4, torch.float32, seed=0)
    before = l1.clone()
    packed = torch.empty((0, 2, 1, 2, 1, 4))
    page_copy.gather_pages(l1, torch.empty(0, dtype=torch.int64), packed, backend)
    page_copy.scatter_pages(packed, torch.empty(0, dtype=torch.int64), l1, backend)
    assert torch.equal(l1, before)  # nothing written (review, session 23: the test asserted nothing)


def test_argument_validation():
    l1 = make_pool(2, 4, 2, 2, 4, torch.float32, seed=0)
    ids = torch.tensor([1, 2])
    good = torch.empty((2, 2, 2, 2, 2, 4))
    with pytest.raises(ValueError, match="dtype"):
        page_copy.gather_pages(l1, ids, good.to(torch.bfloat16), "triton")
    with pytest.raises(ValueError, match="shape"):
        page_copy.gather_pages(l1, ids, torch.empty((3, 2, 2, 2, 2, 4)), "torch")
    with pytest.raises(ValueError, match="int64"):
        page_copy.scatter_pages(good, ids.to(torch.int32), l1, "triton")
    with pytest.raises(ValueError, match="contiguous"):
        page_copy.gather_pages(l1, ids, torch.empty((2, 2, 2, 2, 4, 2)).transpose(-1, -2), "torch")
    with pytest.raises(ValueError, match="backend"):
        page_copy.gather_pages(l1, ids, good, "cuda")


def test_offsets_match_strides_small():
    layers, pool_pages, page_size, heads, head_dim = 3, 7, 4, 2, 8
    l1 = torch.empty((2, layers, pool_pages, page_size, heads, head_dim))
    ids = [5, 0, 6, 2]
    slab = page_size * heads * head_dim
    packed_shape = (len(ids), 2, layers, page_size, heads, head_dim)
    coords = torch.cartesian_prod(*[torch.arange(s) for s in packed_shape])  # [m, 6]
    packed_offsets = (coords * torch.tensor(torch.empty(packed_shape).stride())).sum(1)
    i, kv, layer, tok, head, dim = coords.unbind(1)
    page = torch.tensor(ids)[i]
    strides = l1.stride()
    want = (kv * strides[0] + layer * strides[1] + page * strides[2] + tok * strides[3]
            + head * strides[4] + dim * strides[5])
    got = page_copy.packed_to_l1_offsets(packed_offsets, torch.tensor(ids), layers, pool_pages, slab)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)


def test_offsets_past_int32_do_not_overflow():
    layers, page_size, heads, head_dim, pool_pages = 36, 16, 8, 128, 30000
    slab = page_size * heads * head_dim
    n = 1875  # 30k tokens
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(pool_pages, generator=gen)[:n]
    ids[-1] = pool_pages - 1  # last logical page -> last physical page: the largest offsets
    total = n * 2 * layers * slab
    assert total > 2**31
    offsets = torch.cat([torch.arange(total - 5000, total), torch.randint(0, total, (2000,), generator=gen)])
    got = page_copy.packed_to_l1_offsets(offsets, ids, layers, pool_pages, slab).tolist()
    ids_list = ids.tolist()
    for off, g in zip(offsets.tolist(), got):
        page, rem = divmod(off, 2 * layers * slab)
        layer_kv, inner = divmod(rem, slab)
        assert g == (layer_kv * pool_pages + ids_list[page]) * slab + inner
    assert max(got) > 2**31 and min(got) >= 0


# ----------------------------------------------------------------------------- chooser

def small_pool(dtype=torch.bfloat16) -> torch.Tensor:
    return make_pool(2, 6, 4, 2, 8, dtype, seed=1)


def test_triton_available_under_interpreter():
    assert page_copy.triton_available()


def test_chooser_torch_and_triton_and_auto_cpu():
    l1 = small_pool()
    assert (c := chooser.choose_backends(l1, "torch")).gather == "torch" and c.scatter == "torch"
    c = chooser.choose_backends(l1, "triton")
    assert (c.gather, c.scatter) == ("triton", "triton")
    c = chooser.choose_backends(l1, "auto")
    assert (c.gather, c.scatter) == ("torch", "torch") and "no CUDA" in c.reason
    with pytest.raises(ValueError):
        chooser.choose_backends(l1, "fastest")


def test_chooser_timed_auto_path_on_cpu(monkeypatch):
    """Exercise the CUDA timing branch with perf_counter on CPU; pool must be left unchanged."""
    monkeypatch.setattr(chooser, "_timing_enabled", lambda l1: True)
    l1 = small_pool()
    before = l1.clone()
    c = chooser.choose_backends(l1, "auto", num_pages_sample=3, repeats=1)
    assert set(c.timings_us) == {"gather_triton", "gather_torch", "scatter_triton", "scatter_torch"}
    assert c.gather in BACKENDS and c.scatter in BACKENDS and "auto:" in c.reason
    assert torch.equal(bits(l1), bits(before))


def test_chooser_tolerance_bands(monkeypatch):
    monkeypatch.setattr(chooser, "_timing_enabled", lambda l1: True)
    fake = {"gather_triton": 104.0, "gather_torch": 100.0, "scatter_triton": 103.0, "scatter_torch": 100.0}
    monkeypatch.setattr(chooser, "_time_directions", lambda l1, n, r: dict(fake))
    c = chooser.choose_backends(small_pool(), "auto")
    assert (c.gather, c.scatter) == ("triton", "torch")
    assert c.timings_us == fake


@pytest.mark.parametrize("broken", ["gather_pages_triton", "scatter_pages_triton"])
def test_chooser_failing_triton(monkeypatch, broken):
    def boom(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(page_copy, broken, boom)
    l1 = small_pool()
    with pytest.raises(RuntimeError, match="kernel exploded"):
        chooser.choose_backends(l1, "triton")
    monkeypatch.setattr(chooser, "_timing_enabled", lambda l1: True)
    c = chooser.choose_backends(l1, "auto")
    assert (c.gather, c.scatter) == ("torch", "torch")
    assert "fell back" in c.reason and "kernel exploded" in c.reason


def test_chooser_wrong_results_raise(monkeypatch):
    monkeypatch.setattr(page_copy, "gather_pages_triton", lambda l1, ids, packed: packed.zero_())
    with pytest.raises(RuntimeError, match="disagrees"):
        chooser.choose_backends(small_pool(), "triton")

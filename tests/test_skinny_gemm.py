"""Small-M projections, gate_up with SwiGLU folded in (kernels/skinny_gemm.py, Triton under the
interpreter) against torch: ragged K and N (masked blocks), 1..64 rows (row tiles of 16, 32 and 64), both
operand orders (x @ W^T and the swapped (W @ x^T)^T)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import skinny_gemm  # noqa: E402

SMALL = dict(BLOCK_N=16, BLOCK_K=32)  # several blocks each way at test sizes, with ragged ends
swapped = pytest.mark.parametrize("swapped", [False, True])


def inputs(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5


@swapped
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (5, 72, 40), (16, 96, 33), (17, 64, 40), (32, 72, 33), (50, 96, 48)])
def test_linear_equals_torch(m, k, n, swapped):
    x, w = inputs(m, k, n, m)
    torch.testing.assert_close(skinny_gemm.linear(x, w, SWAPPED=swapped, **SMALL), F.linear(x, w),
                               rtol=1e-5, atol=1e-5)


@swapped
@pytest.mark.parametrize("m,k,inter", [(1, 64, 24), (7, 72, 20), (16, 96, 17), (33, 64, 20)])
def test_swiglu_linear_equals_silu_gate_times_up(m, k, inter, swapped):
    x, w = inputs(m, k, 2 * inter, 10 + m)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    torch.testing.assert_close(skinny_gemm.linear(x, w, swiglu=True, SWAPPED=swapped, **SMALL),
                               F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@swapped
@pytest.mark.parametrize("m,k,n,splits", [(1, 64, 48, 2), (5, 72, 40, 3), (16, 96, 33, 4), (3, 32, 16, 2), (64, 72, 40, 2)])
def test_split_k_partials_add_up_to_the_product(m, k, n, splits, swapped):
    """Each K split's float32 partial sum (ragged last split, a split with no K block at all when K
    is short) adds up to x @ W^T."""
    x, w = inputs(m, k, n, 20 + m)
    parts = skinny_gemm.linear(x, w, split_k=splits, SWAPPED=swapped, **SMALL)
    assert parts.shape == (splits, m, n) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_default_blocks_and_16_bit_inputs():
    """fp16 (the interpreter computes bf16 dots wrongly; bf16 runs on the GPU: tests/test_gpu.py)."""
    x, w = inputs(16, 512, 96, 3)
    x, w = x.half(), w.half()
    torch.testing.assert_close(skinny_gemm.linear(x, w).float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2)


def test_row_tiles_grow_with_the_rows():
    assert [skinny_gemm._row_tile(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]


def test_bad_shapes_are_refused():
    x, w = inputs(skinny_gemm.MAX_ROWS + 1, 64, 32, 0)
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm.linear(x, w)
    with pytest.raises(ValueError, match="equal K"):
        skinny_gemm.linear(x[:4, :32], w)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_gemm.linear(x[:4].t().contiguous().t(), w)
    with pytest.raises(ValueError, match="even"):
        skinny_gemm.linear(x[:4], w[:31], swiglu=True)
    with pytest.raises(ValueError, match="split_k"):
        skinny_gemm.linear(x[:4], w, swiglu=True, split_k=2)
    with pytest.raises(ValueError, match="split_k"):
        skinny_gemm.linear(x[:4], w, split_k=0)


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("dtype_bytes", [2, 4])
@pytest.mark.parametrize("n,k,swiglu", [(6144, 4096, False), (4096, 12288, False), (12288, 4096, True), (48, 64, True)])
def test_block_config_fits_shared_memory(n, k, swiglu, dtype_bytes, block_m):
    """Every shape's pipeline fits the shared-memory budget in bf16 and in float32 (the tiny float32
    GPU tests once asked for 320 KiB) at every row tile, and a K block is never longer than K needs."""
    cfg = skinny_gemm._config(n, k, swiglu, dtype_bytes, block_m=block_m)
    per_stage = (cfg["BLOCK_N"] * (2 if swiglu else 1) + block_m) * cfg["BLOCK_K"] * dtype_bytes
    assert per_stage * cfg["num_stages"] <= skinny_gemm.SHARED_BYTES
    assert cfg["BLOCK_K"] <= max(16, 1 << (k - 1).bit_length())

"""Small-M projections with the norm and SwiGLU folded in (kernels/skinny_gemm.py, Triton under the
interpreter) against norm-then-linear in torch: ragged K and N (masked blocks), 1..16 rows."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import skinny_gemm  # noqa: E402

SMALL = dict(BLOCK_N=16, BLOCK_K=32)  # several blocks each way at test sizes, with ragged ends


def inputs(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g), torch.randn(m, k, generator=g), torch.rand(k, generator=g) + 0.5,
            torch.randn(n, k, generator=g) / k ** 0.5)


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (5, 72, 40), (16, 96, 33)])
def test_linear_equals_torch(m, k, n):
    x, _, _, w = inputs(m, k, n, m)
    torch.testing.assert_close(skinny_gemm.linear(x, w, **SMALL), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,k,n,with_residual,swiglu", [
    (1, 64, 48, True, False), (7, 72, 40, False, False), (16, 96, 33, True, False),
    (3, 64, 2 * 24, True, True), (16, 80, 2 * 20, False, True)])
def test_norm_linear_equals_norm_then_linear(m, k, n, with_residual, swiglu):
    h, res, g, w = inputs(m, k, n, 10 + m)
    residual = res if with_residual else None
    y, s = skinny_gemm.norm_linear(h, residual, g, w, 1e-6, swiglu=swiglu, **SMALL)
    s_ref = h + res if with_residual else h
    y_ref = F.linear(F.rms_norm(s_ref, (k,), g, 1e-6), w)
    if swiglu:
        gate, up = y_ref.chunk(2, dim=-1)
        y_ref = F.silu(gate) * up
    torch.testing.assert_close(s, s_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)


def test_bad_shapes_are_refused():
    x, _, g, w = inputs(17, 64, 32, 0)
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm.linear(x, w)
    with pytest.raises(ValueError, match="equal K"):
        skinny_gemm.linear(x[:4, :32], w)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_gemm.norm_linear(x[:4].t().contiguous().t(), None, g, w, 1e-6)

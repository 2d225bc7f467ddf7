"""kernels/direct_launch.py without a GPU: a stand-in for a Triton JIT function records what the
JIT and the compiled kernel's launcher are called with (the launch itself is checked on the GPU in
tests/test_gpu.py::test_direct_launch_keeps_variants_apart)."""
import contextlib
from types import SimpleNamespace

import torch

from kernels.direct_launch import DirectLaunch


class FakeCompiled:
    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        def runner(*values, stream=None):
            assert len(grid) == 3  # Triton's launcher reads grid[0], grid[1], grid[2]
            self.calls.append(("direct", grid, values, stream))
        return runner


class FakeJit:
    """Parameters (x_ptr, n, page_ptr, BLOCK: constexpr), page_ptr in do_not_specialize."""

    def __init__(self):
        self.calls = []
        self.params = [SimpleNamespace(name="x_ptr", is_constexpr=False, do_not_specialize=False),
                       SimpleNamespace(name="n", is_constexpr=False, do_not_specialize=False),
                       SimpleNamespace(name="page_ptr", is_constexpr=False, do_not_specialize=True),
                       SimpleNamespace(name="BLOCK", is_constexpr=True, do_not_specialize=False)]

    def __getitem__(self, grid):
        def jit(*args, **meta):
            self.calls.append(("jit", grid, args, meta))
            return FakeCompiled(self.calls)
        return jit


def test_first_call_of_a_variant_goes_through_the_jit_then_the_launcher_gets_every_argument(monkeypatch):
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    fn, stream = FakeJit(), SimpleNamespace(cuda_stream=1234)
    launch = DirectLaunch(fn)
    x = torch.zeros(64, dtype=torch.int32)
    launch((4, 2), stream, x, 32, 7, BLOCK=16, num_warps=4)
    assert fn.calls[-1][0] == "jit"
    launch((4, 2), stream, x, 48, 9, BLOCK=16, num_warps=4)  # same variant (48 % 16 == 0)
    kind, grid, values, handle = fn.calls[-1]
    assert (kind, grid, handle) == ("direct", (4, 2, 1), 1234)
    assert values == (x, 48, 9, 16)  # the constexpr in its place; options are not arguments
    launch((4,), stream, x, 1, 9, BLOCK=16, num_warps=4)  # n == 1: another variant
    launch((4,), stream, x[1:], 32, 9, BLOCK=16, num_warps=4)  # misaligned pointer: another
    launch((4,), stream, x, 32, 9, BLOCK=32, num_warps=4)  # another constexpr: another
    launch((4,), stream, x, 32, 9, BLOCK=16, num_warps=8)  # another option: another
    assert [c[0] for c in fn.calls] == ["jit", "direct", "jit", "jit", "jit", "jit"]
    launch((4,), stream, x, 32, 10_000_001, BLOCK=16, num_warps=8)  # page_ptr is not specialised on
    assert fn.calls[-1][0] == "direct" and fn.calls[-1][1] == (4, 1, 1)
    # but every argument's type is: another dtype, or an int past 32 bits, is another variant
    launch((4,), stream, x.view(torch.int16), 32, 9, BLOCK=16, num_warps=8)
    assert fn.calls[-1][0] == "jit"
    launch((4,), stream, x, 32, 1 << 40, BLOCK=16, num_warps=8)
    assert fn.calls[-1][0] == "jit"
    launch((4,), stream, x, 32, 1 << 41, BLOCK=16, num_warps=8)
    assert fn.calls[-1][0] == "direct"

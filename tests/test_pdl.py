"""kernels/pdl.py off the GPU: the switch, and launches that stay ordinary where PDL cannot run."""
import torch

from kernels import pdl


def test_pdl_is_off_on_the_cpu_and_the_switch_returns_the_previous_setting():
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}  # no launch attribute at all
    previous = pdl.set_enabled(True)
    try:
        assert pdl.set_enabled(False) is True  # the setting before, not the new one
        assert pdl.set_enabled(True) is False
        assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}  # switched on, still off here
    finally:
        pdl.set_enabled(previous)
    assert pdl._enabled is previous


class _Compiled:
    """Stands in for a compiled Triton kernel: what pdl.spread reads and reloads."""

    def __init__(self, shared_bytes: int, fail: bool = False) -> None:
        from collections import namedtuple

        from triton.backends.compiler import GPUTarget

        meta = namedtuple("KernelMetadata", "num_ctas num_warps shared target")
        self.metadata = meta(1, 4, shared_bytes, GPUTarget("cuda", 90, 32))
        self.packed_metadata = (4, 1, shared_bytes)
        self.module, self._run, self.loads, self.fail = "module", "launcher", 0, fail

    def _init_handles(self) -> None:
        if self.fail:
            raise RuntimeError("another Triton")
        self.module, self._run, self.loads = "reloaded", "launcher", self.loads + 1


def test_spread_asks_for_the_shared_memory_once_and_reloads_the_module():
    kernel = _Compiled(64 << 10)
    assert pdl.spread(kernel, torch.device("cpu"), want_bytes=128 << 10)
    assert kernel.metadata.shared == 128 << 10 and kernel.packed_metadata == (4, 1, 128 << 10)
    assert kernel.loads == 1 and kernel.module == "reloaded"
    assert pdl.spread(kernel, torch.device("cpu"), want_bytes=128 << 10) and kernel.loads == 1  # once


def test_spread_leaves_a_kernel_that_already_asks_for_enough_or_cannot_be_reloaded():
    big = _Compiled(160 << 10)
    assert pdl.spread(big, torch.device("cpu"), want_bytes=128 << 10)
    assert big.metadata.shared == 160 << 10 and big.loads == 0
    odd = _Compiled(64 << 10, fail=True)
    assert not pdl.spread(odd, torch.device("cpu"), want_bytes=128 << 10)
    assert odd.metadata.shared == 64 << 10 and odd.packed_metadata == (4, 1, 64 << 10)  # launches as compiled

"""hicache/pinned.py's bookkeeping on any machine: the exact bytes are registered as portable |
mapped, the registration ends when its owner goes and before its memory is freed, and a refusal
falls back to torch's pinned allocator. (The runtime's side, on a GPU:
tests/test_gpu_transfers.py::test_l2_is_pinned_at_its_exact_size_outside_torchs_host_allocator.)"""
import gc
import mmap

import torch

from hicache import pinned


class _Runtime:
    """Records the calls hicache/pinned.py makes to CUDA's runtime."""

    def __init__(self, register_code: int = 0) -> None:
        self.register_code, self.calls = register_code, []

    def cudaHostRegister(self, ptr, num_bytes, flags):  # noqa: N802 - the runtime's name
        self.calls.append(("register", ptr, num_bytes, flags))
        return self.register_code

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


class _Owner:
    pass


def test_exact_bytes_registered_until_the_owner_goes(monkeypatch):
    runtime = _Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    owner = _Owner()
    buf = pinned.pinned_zeros(owner, (3, 2, 5), torch.bfloat16)
    assert buf.shape == (3, 2, 5) and buf.dtype == torch.bfloat16 and not buf.any()
    assert runtime.calls == [("register", buf.data_ptr(), 3 * 2 * 5 * 2, 0x01 | 0x02)]
    assert buf.data_ptr() % mmap.PAGESIZE == 0  # its own mapping, not torch's allocator
    ptr = buf.data_ptr()
    del owner
    gc.collect()
    assert runtime.calls[-1] == ("unregister", ptr)
    buf.fill_(1)  # still the caller's memory after the registration ended
    assert buf.sum().item() == 30


def test_a_refused_registration_falls_back_to_torchs_pinned_allocator(monkeypatch):
    runtime = _Runtime(register_code=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    made = []
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):
        made.append(kwargs.get("pin_memory", False))
        return real_zeros(*args, **{k: v for k, v in kwargs.items() if k != "pin_memory"})

    monkeypatch.setattr(torch, "zeros", zeros)
    owner = _Owner()
    buf = pinned.pinned_zeros(owner, (4, 4), torch.float16)
    assert buf.shape == (4, 4) and made == [True]
    del owner
    gc.collect()
    assert [c[0] for c in runtime.calls] == ["register"]  # nothing registered, nothing to end


def test_an_empty_pool_registers_nothing(monkeypatch):
    runtime = _Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    assert pinned.pinned_zeros(_Owner(), (0, 2, 4), torch.bfloat16).numel() == 0
    assert runtime.calls == []

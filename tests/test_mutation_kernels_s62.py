"""Session 62's mutation check of the copy kernels' front doors (kernels/page_copy.py, host_copy.py,
layer_flags.py): argument rules no earlier test pinned. On the CPU (Triton under TRITON_INTERPRET=1); a layout
too large to allocate is checked on meta tensors, whose shapes are all the checks read."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import page_copy  # noqa: E402


def _pool(kv: int = 2) -> torch.Tensor:
    return torch.arange(kv * 2 * 4 * 2 * 2 * 4, dtype=torch.float32).reshape(kv, 2, 4, 2, 2, 4)  # [kv, L, P, S, H, D]


@pytest.mark.parametrize("backend", page_copy.BACKENDS)
def test_an_l1_pool_without_exactly_k_and_v_is_refused(backend):
    """L1 is [2 (K/V), L, P, S, H, D]: a pool of three planes is refused by name, not copied in part (the
    Triton kernel would move the first two and leave the rest unsaid)."""
    ids = torch.tensor([1, 3])
    packed = torch.zeros((2, 2, 2, 2, 2, 4))
    with pytest.raises(ValueError, match=r"l1 must be \[2, L, P, S, H, D\]"):
        page_copy.gather_pages(_pool(kv=3), ids, packed, backend)
    with pytest.raises(ValueError, match=r"l1 must be \[2, L, P, S, H, D\]"):
        page_copy.scatter_pages(packed, ids, _pool(kv=3), backend)
    assert not packed.any()


def test_page_ids_on_another_device_than_the_pool_are_refused():
    """Page ids live on the pool's device (the kernel reads them there): ids elsewhere are a device mismatch
    naming all three devices, whatever the packed buffer's device."""
    ids = torch.tensor([1, 3], device="meta")
    with pytest.raises(ValueError, match="device mismatch"):
        page_copy.gather_pages(_pool(), ids, torch.zeros((2, 2, 2, 2, 2, 4)), "triton")


def test_a_slab_too_large_for_one_grid_is_refused_before_any_launch():
    """A page slab (S*H*D elements) needing more than 65,535 blocks of 1,024 along the grid's second axis is a
    clear error, not a launch the device refuses (meta tensors: nothing is allocated)."""
    slab = 65536 * 1024  # elements: 65,536 blocks
    l1 = torch.empty((2, 1, 2, 1, 1, slab), dtype=torch.bfloat16, device="meta")
    packed = torch.empty((1, 2, 1, 1, 1, slab), dtype=torch.bfloat16, device="meta")
    ids = torch.zeros(1, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="too large for one page copy grid"):
        page_copy.gather_pages_triton(l1, ids, packed)


def test_a_layer_wait_waits_for_its_own_epoch_not_the_eager_one():
    """A captured graph's LayerWait reads the epoch it staged itself, for its wait kernel and for the attention
    that spins on it (`kernel_args`), not `LayerFlags.expected` (the eager forwards' epoch): a graph replayed for a
    later restore would otherwise pass layers still holding the earlier restore's K/V."""
    from kernels.decode_attention import decode_attention_triton
    from kernels.layer_flags import LayerFlags, LayerWait

    flags = LayerFlags(1, torch.device("cpu"), max_spins=20)
    flags.flags.fill_(3)  # the earlier restore (epoch 3) landed; the graph's own restore is epoch 4
    flags.expected.fill_(3)
    wait = LayerWait(flags, torch.tensor([4]))
    wait(0)
    assert flags.timed_out()
    torch.manual_seed(3)
    k, v = torch.randn(4, 4, 2, 16), torch.randn(4, 4, 2, 16)
    tables, lens, q = torch.arange(4).reshape(1, 4), torch.tensor([13]), torch.randn(1, 4, 16)
    decode_attention_triton(q, k, v, tables, lens, 0.25, wait=wait.kernel_args(0))
    assert flags.timed_out()

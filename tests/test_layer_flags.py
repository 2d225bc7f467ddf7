"""The device-side layer wait of kernels/layer_flags.py (the Triton interpreter on the CPU): a
forward's wait passes layers whose flag reached its epoch and gives up on the rest, and epochs
start again before the int32 flags would wrap. Restores overlapped with their forward:
tests/test_restore_overlap.py."""
from __future__ import annotations

import torch


def test_layer_wait_passes_landed_layers_and_gives_up_on_missing_ones():
    from kernels.layer_flags import LayerFlags

    flags = LayerFlags(4, torch.device("cpu"), max_spins=20)
    flags.flags.copy_(torch.tensor([3, 2, 0, 7], dtype=torch.int32))  # epochs the copy stream wrote
    flags.expected.fill_(2)
    seen = []
    for layer in range(4):
        flags.wait(layer)
        seen.append(flags.timed_out())
    assert seen == [False, False, True, False]  # only layer 2 (epoch 0 < 2) never landed
    assert flags.flags.tolist() == [3, 2, 0, 7]  # the wait's acquire read (an atomic add of 0) left them
    assert not flags.timed_out()  # reading the status clears it
    staged = torch.tensor([8])  # a graph's own staged epoch instead of `expected`
    flags.wait(3, staged)
    assert flags.timed_out()


def test_epochs_start_again_before_the_int32_flags_would_wrap():
    """Regression: flags are int32 and a wait casts the epoch to int32, so restore 2^31's wait
    (-2^31 as an int32) passed at once against a layer still at 2^31 - 1, and its forward read
    stale KV (~25 days at 1,000 restores a second). Epochs now start again from 1 there, with the
    flags back to 0, and a wait for the new epoch waits."""
    from kernels.layer_flags import EPOCH_LIMIT, LayerFlags

    flags = LayerFlags(2, torch.device("cpu"), max_spins=20)
    flags.epoch = EPOCH_LIMIT
    flags.flags.fill_(EPOCH_LIMIT)  # the last old epoch landed everywhere
    epoch = flags.next_epoch()
    assert epoch == 1 and flags.flags.tolist() == [0, 0]
    flags.wait(0, torch.tensor([epoch]))
    assert flags.timed_out()  # not landed yet: the wait holds
    flags.flags[1] = epoch
    flags.wait(1, torch.tensor([epoch]))
    assert not flags.timed_out()

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

"""Transfer engine on the CPU: every host layout (one run, a few runs, scattered) moves the exact
bytes, and only scattered destinations need the pinned workspace and a CPU index copy."""
import random

import pytest
import torch

from hicache.geometry import KVGeometry
from hicache.pools import DevicePool, HostPool
from hicache.transfer import MAX_DMA_RUNS, TransferEngine, host_runs
from kernels.chooser import ChosenBackends

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)


def layouts(n):
    rng = random.Random(0)
    few = [p for run in ([10 + i for i in range(5)], [40 + i for i in range(n - 5)]) for p in run]
    scattered = rng.sample(range(64), n)
    return {"consecutive": list(range(20, 20 + n)), "few_runs": few, "scattered": scattered}


@pytest.mark.parametrize("layout", ["consecutive", "few_runs", "scattered"])
def test_round_trip_is_exact_for_every_host_layout(layout):
    n = 12
    host_pages = layouts(n)[layout]
    assert (len(host_runs(host_pages)) == 1) == (layout == "consecutive")
    if layout == "scattered":
        assert len(host_runs(host_pages)) > MAX_DMA_RUNS
    l1 = DevicePool(GEOM, 32, torch.device("cpu"))
    l2 = HostPool(GEOM, 64, pin=False)
    l1.kv.view(torch.int16).random_(-30000, 30000)
    engine = TransferEngine(l1, l2, ChosenBackends("torch", "torch", {}, "test"))
    src = random.Random(1).sample(range(32), n)
    original = l1.kv[:, :, src].clone()
    engine.wait_blocking(engine.d2h(src, host_pages))
    assert torch.equal(l2.page_buffer[host_pages].view(torch.int16),
                       original.permute(2, 0, 1, 3, 4, 5).contiguous().view(torch.int16))
    dst = random.Random(2).sample(range(32), n)
    engine.wait_blocking(engine.h2d(host_pages, dst))
    assert torch.equal(l1.kv[:, :, dst].view(torch.int16), original.view(torch.int16))
    needs_host_workspace = layout == "scattered"
    assert any(w.host is not None for w in engine._workspaces) == needs_host_workspace
    engine.close()


"""The transfer engine's scratch buffers (hicache/workspaces.py): reused best fit, the pinned half
only on demand, at most one idle buffer kept."""
import torch

from hicache.geometry import KVGeometry
from hicache.workspaces import Workspaces

GEOM = KVGeometry(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def test_reuse_is_best_fit_and_the_host_half_comes_only_when_asked() -> None:
    pool = Workspaces(GEOM, torch.device("cpu"))
    small, setup_ns = pool.acquire(4, needs_host=False)
    assert small.device.shape == GEOM.page_major_shape(4) and small.host is None and setup_ns >= 0
    big, _ = pool.acquire(16, needs_host=False)
    assert big is not small and len(pool) == 2
    pool.release(small)
    again, _ = pool.acquire(3, needs_host=True)  # the smallest free one that fits, its host half added
    assert again is small and again.host is not None and again.host.shape == again.device.shape
    assert again.busy and big.busy
    pool.release(big)
    fits, _ = pool.acquire(5, needs_host=False)  # small is busy and too short anyway: big
    assert fits is big


def test_at_most_one_idle_workspace_is_kept_the_largest() -> None:
    pool = Workspaces(GEOM, torch.device("cpu"))
    taken = [pool.acquire(n, needs_host=False)[0] for n in (2, 8, 4)]
    for ws in taken:
        pool.release(ws)
    assert [w.num_pages for w in pool] == [8] and not any(w.busy for w in pool)
    pool.release(None)  # a transfer without a workspace
    assert len(pool) == 1
    pool.clear()
    assert len(pool) == 0

"""HiCacheConfig's field types, for what the in-process API may be given that the flags' parser never makes:
a ValueError naming the field (enable="false" turned the tiers on; a host_ratio of "2" was a TypeError from a
comparison; an io_workers of 2.5 failed the engine's start in its thread pool)."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from hicache.config import HiCacheConfig
from scheduler.config import EngineConfig


@pytest.mark.parametrize("field, value, says", [
    ("enable", "false", "True or False"), ("prefetch", 1, "True or False"), ("storage_persist", None, "True or False"),
    ("host_ratio", "2", "a number"), ("cost_margin", True, "a number"), ("host_size_gb", "1", "a number"),
    ("io_workers", 2.5, "an integer"), ("restore_explore_every", True, "an integer"),
    ("kernel_restore_max_tokens", "4096", "an integer"),
    ("model_id", None, "a string"), ("storage_path", 3, "a string"), ("storage_url", b"redis://h", "a string"),
])
def test_a_field_of_the_wrong_type_is_named(field, value, says):
    with pytest.raises(ValueError, match=f"hicache.{field} must be {says}"):
        HiCacheConfig(**{field: value})
    with pytest.raises(ValueError, match=f"hicache.{field}"):  # (as the engine's config is given it)
        EngineConfig(model="tiny", device="cpu").with_hicache(**{field: value})


def test_numpy_numbers_and_paths_are_taken_as_pythons(tmp_path):
    cfg = HiCacheConfig(io_workers=np.int64(3), host_ratio=np.float32(1.5), storage_size_gb=np.float64(0.5),
                        host_size_gb=None, storage_path=pathlib.Path(tmp_path / "l3.bin"))
    assert (cfg.io_workers, cfg.host_ratio, cfg.storage_size_gb) == (3, 1.5, 0.5)
    assert type(cfg.io_workers) is int and type(cfg.host_ratio) is float
    assert cfg.storage_path == str(tmp_path / "l3.bin")
    assert HiCacheConfig(host_ratio=2).host_ratio == 2.0  # (an int where a float is asked)

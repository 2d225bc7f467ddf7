"""Bug hunt (session 80): --hicache-storage-persist asks that the L3 file's prefixes be kept across restarts; with
an L3 of no page asked for (--hicache-storage-ratio 0 or --hicache-storage-size-gb 0) there is no L3 file, and the
engine used to start without a word, nothing kept for the next one."""
from __future__ import annotations

import pytest

from hicache.config import HiCacheConfig
from scheduler import serve
from scheduler.config import config_from_args


@pytest.mark.parametrize("no_l3", [{"storage_ratio": 0.0}, {"storage_size_gb": 0.0},
                                   {"storage_ratio": 3.0, "storage_size_gb": 0.0}])
def test_persist_without_an_l3_is_refused_naming_the_flags(tmp_path, no_l3):
    with pytest.raises(ValueError, match="--hicache-storage-persist.*--hicache-storage-"):
        HiCacheConfig(enable=True, storage_path=str(tmp_path / "l3"), storage_persist=True, **no_l3)


def test_persist_with_an_l3_sized_by_either_flag_starts(tmp_path):
    HiCacheConfig(enable=True, storage_path=str(tmp_path / "l3"), storage_persist=True, storage_ratio=0.0,
                  storage_size_gb=1.0)  # (the size wins over a ratio of 0)
    HiCacheConfig(enable=True, storage_path=str(tmp_path / "l3"), storage_persist=True)


def test_the_servers_flags_refuse_persist_without_an_l3(tmp_path):
    """What `hicache-serve` builds its config from (it prints the ValueError and exits 2 before the model loads)."""
    argv = ["--enable-hicache", "--hicache-storage-persist", "--hicache-storage-path", str(tmp_path / "l3"),
            "--hicache-storage-ratio", "0"]
    with pytest.raises(ValueError, match="--hicache-storage-persist.*--hicache-storage-ratio"):
        config_from_args(serve.build_parser().parse_args(argv))

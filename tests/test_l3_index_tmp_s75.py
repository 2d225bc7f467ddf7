"""A kept L3 file's index is saved to `PATH.index.tmp`, then renamed (hicache/l3_index.py `save`): a process killed
mid-save (kill -9, a power loss) left that temporary file, up to tens of MiB, beside the L3 file until some later run
saved an index again; a run without --hicache-storage-persist on the path never removed it. A start that opens the
file (and holds its lock) now removes it, with or without the flag, and adopts the index as before."""
from __future__ import annotations

import asyncio
import os

import pytest

from hicache.l3_index import index_path
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

PROMPT = [(5 * i + 2) % 200 + 5 for i in range(17)]  # 4 whole pages of 4 tokens


def _config(path, persist: bool) -> EngineConfig:
    return EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=4).with_hicache(
        enable=True, policy="always", transfer_backend="torch", storage_path=str(path), storage_persist=persist)


async def _serve_and_keep(path) -> None:
    eng = Engine(_config(path, True))
    await eng.generate_async([PROMPT], SamplingParams(max_tokens=2))
    await eng.cache.drain()
    await eng.shutdown()


@pytest.mark.parametrize("persist", [True, False], ids=["kept", "not_kept"])
def test_a_crashed_saves_temporary_index_goes_at_the_next_start(tmp_path, persist):
    path = tmp_path / "l3.kv"
    asyncio.run(_serve_and_keep(path))
    tmp = index_path(str(path)) + ".tmp"
    with open(tmp, "wb") as f:  # (what a save killed half-way leaves)
        f.write(b"PK\x03\x04" + bytes(4096))
    eng = Engine(_config(path, persist))
    assert not os.path.exists(tmp)
    assert (eng.metrics()["storage_adopted_pages"] >= 4) == persist
    asyncio.run(eng.shutdown())

"""Session 40: under write_back a backup wakes the engine's loop twice, once its L1 copy is done (its L1
pages may be evicted now: a request waiting for room must not sleep through the L3 write) and once it
ends. The end frees no L1 room; it ended the decode chain all the same, at a step that the L3 write's
thread timing chose."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from hicache_helpers import assert_whole
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams


def chained_steps(l3: bool, tmp_path) -> tuple[int, list[list[int]], int]:
    """6 requests whose pages fit two at a time: each admission evicts (and so first backs up) the
    leaves of two that finished. With an L3 file whose writes take 20 ms each, every backup ends
    during the decode of the next pair."""
    cfg = EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=12)  # (12 pages: 5 a request)
    hc = dict(storage_ratio=4.0, storage_path=str(tmp_path / "l3.bin")) if l3 else dict(storage_ratio=0.0)
    eng = Engine(cfg.with_hicache(enable=True, policy="always", write_policy="write_back", **hc))
    if l3:
        write, pool = eng.cache.store.write_pages, ThreadPoolExecutor(1)

        def slow_write(*args, **kwargs):
            def late():
                time.sleep(0.02)
                return write(*args, **kwargs).result()
            return pool.submit(late)

        eng.cache.store.write_pages = slow_write
    results = eng.generate([[i + 1] * 9 for i in range(6)], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.check_integrity()
    assert_whole(eng.cache)
    return eng.stats["chained_steps"], [r.output_ids for r in results], eng.cache.metrics.backups_done


def test_a_write_back_backups_l3_write_ending_does_not_end_the_decode_chain(tmp_path):
    """Regression: the chain count with an L3 was below the one without it, by one for each backup
    whose L3 write ended during a chain."""
    without_l3, outputs, _ = chained_steps(False, tmp_path)
    with_l3, outputs_l3, backups = chained_steps(True, tmp_path)
    assert backups > 0 and outputs_l3 == outputs
    assert with_l3 == without_l3

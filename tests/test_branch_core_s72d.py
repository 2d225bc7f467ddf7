"""Session 72 branch-coverage hunt, core (engine setup, the replay's tools): the sides of branches
no test took, each pinned as the rule a user meets.

- `--device cuda` on a machine without CUDA is refused with one clear ValueError (not a CUDA error deep in a kernel).
- `--cpu-threads 0` (the replay's "this machine's CPUs") leaves torch's intra-op thread count as it is; a count > 0
  sets it.
- The replay's memory summary (`pool_pages`) of a cache with no L2 page (--hicache-size-gb 0 / --hicache-ratio 0)
  gives L2 and L3 0 pages, not the L3 sizing's unrelated "raise --hicache-storage-ratio" error.
- The replay's progress bar (stderr a terminal, unless --no-progress) counts each request once and is closed at the
  end of the run (left open, tqdm's line stays on the terminal, under the summary).
- A trace record with no hash ids (no blocks) keeps its scaled input length: it is not clamped into 0 blocks."""
from __future__ import annotations

import sys

import pytest
import torch
import tqdm

from scheduler import engine as engine_module
from scheduler.config import EngineConfig, resolve_device
from scheduler.engine import Engine
from scheduler.replay import run_cli
from scheduler.replay_memory import pool_pages
from scheduler.trace import TraceRecord, scale_record


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_device_cuda_without_cuda_is_refused_clearly():
    with pytest.raises(ValueError, match="^--device cuda requested but CUDA is not available$"):
        resolve_device(EngineConfig(model="tiny", device="cuda"))


@pytest.mark.parametrize("threads,sets", [(0, []), (1, [1])])
def test_cpu_threads_zero_leaves_torchs_thread_count(monkeypatch, threads, sets):
    calls = []
    monkeypatch.setattr(engine_module.torch, "set_num_threads", calls.append)
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=32, page_size=4, cpu_threads=threads))
    assert calls == sets
    eng.check_integrity()


@pytest.mark.parametrize("hicache", [{"host_size_gb": 0}, {"host_ratio": 0.0}], ids=["size-0", "ratio-0"])
def test_the_memory_summary_of_a_cache_with_no_l2_page_says_0_pages(hicache):
    cfg = EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4).with_hicache(enable=True, **hicache)
    assert pool_pages(cfg) == {"L1": 64, "L2": 0, "L3": 0}


def test_a_trace_record_with_no_blocks_keeps_its_scaled_input():
    rec = TraceRecord(line_no=1, timestamp_ms=0.0, input_tokens=3000, output_tokens=10, hash_ids=())
    scaled = scale_record(rec, 64)
    assert (scaled.input_tokens, scaled.output_tokens, scaled.hash_ids) == (375, 1, ())
    blocks = scale_record(TraceRecord(line_no=1, timestamp_ms=0.0, input_tokens=3000, output_tokens=10,
                                      hash_ids=(1, 2)), 64)
    assert blocks.input_tokens == 128  # (with blocks: at most theirs)



@pytest.mark.parametrize("tty", ["stderr", "stdout"])
def test_the_replays_progress_bar_counts_each_request_and_is_closed(monkeypatch, tty):
    """The bar is drawn where tqdm draws it, on stderr, when that is a terminal, whatever stdout is (regression: it
    asked stdout, so `hicache-replay > summary.txt` hid the bar from the terminal, and `2> log` filled the log with
    it)."""
    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.done, self.closed = total, 0, 0
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed += 1
    monkeypatch.setattr(tqdm, "tqdm", Bar)
    monkeypatch.setattr(getattr(sys, tty), "isatty", lambda: True)
    summary = run_cli(["--simulate", "--max-requests", "3"])
    assert summary["integrity"] == "passed"
    if tty == "stdout":
        assert bars == []
        return
    [bar] = bars
    assert (bar.total, bar.done, bar.closed) == (3, 3, 1)

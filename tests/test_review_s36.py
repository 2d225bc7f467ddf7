"""Regressions for what session 36 fixed in the replay driver and the pool-sizing messages."""
from __future__ import annotations

import sys

import pytest

from scheduler.replay import run_cli

GOOD = '{"timestamp": %d, "input_length": 700, "output_length": 4, "hash_ids": [%d, %d]}'


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(GOOD % (i, i % 2, 10 + i) for i in range(4)) + "\n")
    return ["--trace", str(path), "--block-tokens", "16", "--time-scale", "0", "--concurrency", "1",
            "--max-output-tokens", "2", "--l1-tokens", "512", "--l2-tokens", "1024", "--l3-tokens", "0",
            "--no-progress"]


def test_a_baseline_that_cannot_start_is_one_line_not_a_traceback(small_trace, monkeypatch, capsys):
    """regression: --compare-no-cache built its baseline engine outside the replay's error handling, so
    an engine refusing the baseline's configuration (a second engine finding less memory than the
    first, session 35's review) ended the run in a traceback after the replay's own summary."""
    from scheduler import engine as engine_mod

    monkeypatch.setattr(sys, "argv", ["replay_trace.py"])  # (the program's name starts its lines)
    real_init = engine_mod.Engine.__init__

    def init(self, config=None, faults=None):
        if config is not None and not config.enable_prefix_cache:  # the baseline's engine only
            raise ValueError("L1 of 0 pages: fewer than one request needs (--gpu-memory-fraction)")
        real_init(self, config, faults)

    monkeypatch.setattr(engine_mod.Engine, "__init__", init)
    with pytest.raises(SystemExit) as info:
        run_cli([*small_trace, "--compare-no-cache"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "replay_trace.py: --compare-no-cache baseline: L1 of 0 pages" in err, err
    assert "Traceback" not in err


def test_bench_http_refuses_an_abbreviated_flag_of_its_own(capsys):
    """regression: bench_http.py passes every flag it does not own on to the server it starts, by exact
    name; argparse took `--new-tok 8` for --new-tokens, and the server was started with `--new-tok 8`
    too (an unknown flag there: the server never came up). Abbreviations are refused at once."""
    from test_bench_smoke import load

    with pytest.raises(SystemExit) as info:
        load("bench_http").main(["--quick", "--model", "tiny", "--device", "cpu", "--new-tok", "8"])
    assert info.value.code == 2
    assert "unrecognized arguments: --new-tok 8" in capsys.readouterr().err


def test_a_prompt_past_the_models_positions_meets_the_one_prompt_limit():
    """regression: Engine.max_prompt_tokens was the L1 pool's size alone (8,192 tokens for the tiny
    preset on the CPU, whose model has 4,096 positions): a prompt of 4,097..8,192 tokens passed that
    limit and was refused by a second check with another message (the replay showed both)."""
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.request import RequestError, SamplingParams

    eng = Engine(EngineConfig(model="tiny", max_total_tokens=8192))
    assert eng.max_kv_tokens == eng.model_config.max_position_embeddings == 4096
    assert eng.max_prompt_tokens == 4096
    messages = set()
    for n in (5000, 9000):
        with pytest.raises((RequestError, ValueError)) as info:
            eng.validate([1] * n, SamplingParams(max_tokens=1))
        messages.add(str(info.value).replace(str(n), "N"))
    assert len(messages) == 1 and "4096" in messages.pop()


def test_a_storage_path_beside_the_redis_backend_is_refused_for_that_not_for_its_directory(capsys):
    """review: the server checked --hicache-storage-path's directory before the config said the path is
    only used by the file backend: a missing directory was the message, not the real problem."""
    from scheduler.serve import main

    code = main(["--port", "0", "--model", "tiny", "--enable-hicache", "--hicache-storage-backend", "redis",
                 "--hicache-storage-url", "redis://127.0.0.1:1/0", "--hicache-storage-path", "/no/such/dir/l3.kv"])
    err = capsys.readouterr().err
    assert code == 2 and "only used by --hicache-storage-backend file" in err, err

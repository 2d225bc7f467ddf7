from pathlib import Path

from scheduler import replay

SAMPLE = str(Path(__file__).resolve().parents[1] / "scheduler" / "sample_trace.jsonl")


def test_a_replay_says_up_front_how_many_requests_cannot_fit_the_models_positions(capsys):
    """Session 39. Regression: the bundled sample given as --trace runs at the trace's 512 tokens a hash id,
    and on the tiny preset (4,096 positions) 214 of its 300 requests failed; the replay said so only after
    it ran, ten errors at a time. Now one line before it names how many and the flags that clip them."""
    summary = replay.run_cli(["--trace", SAMPLE, "--max-requests", "6", "--simulate", "--no-progress"])
    err = capsys.readouterr().err
    failed = sum("exceeds" in e["error"] or "positions" in e["error"] for e in summary["errors"])
    assert failed > 0
    line = next(ln for ln in err.splitlines() if "positions" in ln and "will fail" in ln)
    assert f"{failed} of 6 requests need more than the model's 4,096 positions" in line, err
    assert "--max-input-tokens" in line and "--block-tokens 512" in line, line
    replay.run_cli(["--trace", SAMPLE, "--max-requests", "6", "--simulate", "--no-progress", "--max-input-tokens",
                    "2048", "--max-output-tokens", "8"])
    assert "will fail" not in capsys.readouterr().err


def test_the_line_before_a_replay_counts_the_requests_past_the_l1_pool_too(capsys):
    """Session 51. Regression: --simulate at the 8B shape, its L1 the CPU's default 8,192 tokens, failed 148 of the
    sample's 300 requests as too large for the pool, where the line before the replay counted the 15 past the
    model's positions. Now the line counts what the pool refuses too, and names the flag that sizes it."""
    argv = ["--trace", SAMPLE, "--max-requests", "12", "--simulate", "--no-progress", "--model", "qwen3-8b",
            "--time-scale", "0", "--l1-tokens", "4096"]
    summary = replay.run_cli(argv)
    err = capsys.readouterr().err
    failed = len(summary["errors"])
    assert failed > 0 and summary["completed"] > 0
    line = next(ln for ln in err.splitlines() if "will fail" in ln)
    assert f"{failed} of 12 requests need more than the L1 pool's 4,096 tokens (--l1-tokens 4096 sizes it)" in line, err
    replay.run_cli(argv[:-1] + ["200000", "--max-input-tokens", "30000"])
    assert "will fail" not in capsys.readouterr().err


def test_a_replay_s_report_masks_the_storage_url_s_password(tmp_path, capsys):
    """Session 51, regression: --json-out dumped the engine's settings whole, a Redis L3's password in clear, where
    the logs and /hicache/status mask it."""
    out = tmp_path / "out.json"
    replay.run_cli(["--simulate", "--max-requests", "2", "--no-progress", "--enable-hicache",
                    "--hicache-storage-backend", "redis", "--hicache-storage-url", "redis://:s3cretPW@127.0.0.1:1/0",
                    "--json-out", str(out)])
    text = out.read_text()
    assert "s3cretPW" not in text and "redis://:***@127.0.0.1:1/0" in text
    assert "s3cretPW" not in capsys.readouterr().out


def test_the_line_before_a_replay_counts_outputs_past_the_max_tokens_limit(tmp_path, capsys):
    """Session 57. Regression: a trace asking for more output tokens than the engine's max_tokens limit (4,096) failed
    every such request, said only after the replay; now a line before it counts them and names the flag that clips."""
    trace = tmp_path / "long.jsonl"
    lines = [f'{{"timestamp": {i}, "input_length": 512, "output_length": {n}, "hash_ids": [{i}]}}'
             for i, n in enumerate((6000, 8, 5000))]
    trace.write_text("\n".join(lines) + "\n")
    argv = ["--trace", str(trace), "--simulate", "--no-progress", "--time-scale", "0",
            "--model", "qwen3-8b", "--l1-tokens", "200000"]
    summary = replay.run_cli(argv)
    line = next(ln for ln in capsys.readouterr().err.splitlines() if "will fail" in ln)
    assert "2 of 3 requests ask for more than the engine's 4,096 output tokens (outputs of up to 6,000)" in line
    assert "--max-output-tokens" in line and summary["failed"] == 2
    replay.run_cli(argv + ["--max-output-tokens", "4096"])
    assert "will fail" not in capsys.readouterr().err

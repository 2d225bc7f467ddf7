"""Scripts' fixes (session 38): check_restore_equivalence.py counted a recomputed iteration as a
restored, byte-identical one (and lost prompt 0's L2 copy in its setup); the replay's parser named
itself replay_trace.py under any name (hicache-replay, probe_start.py). Each test names what it
failed with."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESTORE = ["scripts/check_restore_equivalence.py", "--model", "tiny", "--device", "cpu", "--prefix-tokens", "128",
           "--iterations", "4"]


def _script(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def _counts(stdout: str) -> dict[str, tuple[int, int]]:
    """'restored', 'identical', 'token' -> (n, of) from the script's summary line."""
    found = {key: re.search(pattern, stdout) for key, pattern in (
        ("restored", r"(\d+)/(\d+) restored from L2/L3"), ("identical", r"byte-identical (\d+)/(\d+)"),
        ("token", r"first token == L1-hit (\d+)/(\d+)"))}
    assert all(found.values()), stdout
    return {key: (int(m[1]), int(m[2])) for key, m in found.items()}


def test_every_iteration_of_the_restore_check_is_restored():
    """regression: "3/4 restored from L2/L3": the setup evicted L1 and L2 before each prompt, so prompt
    0's L2 copy was gone before the iterations and iteration 0 was a recompute."""
    proc = _script(*RESTORE)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc
    assert _counts(proc.stdout) == {"restored": (4, 4), "identical": (4, 4), "token": (4, 4)}, proc.stdout


def test_an_iteration_not_restored_is_not_counted_as_restored_and_fails_the_check():
    """regression: with an L2 of one prompt (--host-ratio 1: 13 pages, a prompt is 9) nothing was
    restored, yet it printed "0/4 restored ...; restored KV byte-identical 4/4" and exited 0: the
    recompute's KV was compared with the recompute's."""
    proc = _script(*RESTORE, "--host-ratio", "1.0")
    counts = _counts(proc.stdout)
    assert counts["restored"][0] < 4, proc.stdout  # (the setup this test needs)
    assert counts["identical"][0] <= counts["restored"][0] and counts["token"][0] <= counts["restored"][0], counts
    assert proc.returncode == 1, proc
    lines = [line for line in proc.stderr.splitlines() if "restored" in line]
    assert len(lines) == 1 and f"{counts['restored'][0]} of 4 iterations" in lines[0], proc.stderr


def _console_script(tmp_path: Path) -> Path:
    """pip's shim for `hicache-replay = "scheduler.replay:main"` (pyproject.toml), under that name."""
    shim = tmp_path / "hicache-replay"
    shim.write_text("import sys\nfrom scheduler.replay import main\nif __name__ == '__main__':\n"
                    "    sys.exit(main())\n")
    return shim


def test_hicache_replay_names_itself_in_its_help_and_errors(tmp_path):
    """regression: `hicache-replay --help` said "usage: replay_trace.py" and `hicache-replay --l2-gib 0`
    "replay_trace.py: error: ...": build_parser forced prog="replay_trace.py"."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    shim = str(_console_script(tmp_path))
    proc = _script(shim, "--help", env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: hicache-replay "), proc.stdout[:200]
    proc = _script(shim, "--l2-gib", "0", env=env)
    assert proc.returncode == 2 and "hicache-replay: error: --l2-gib must be > 0" in proc.stderr, proc.stderr
    assert "replay_trace.py" not in proc.stderr, proc.stderr
    proc = _script("scripts/replay_trace.py", "--help")  # (its own name where the script is run)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: replay_trace.py "), proc.stdout[:200]


def test_probe_starts_help_describes_probe_start():
    """regression: `probe_start.py --help` said "usage: replay_trace.py", its own --top last in the usage
    line, after every replay flag."""
    proc = _script("scripts/probe_start.py", "--help")
    out = proc.stdout
    assert proc.returncode == 0 and out.startswith("usage: probe_start.py "), out[:200]
    usage = out[:out.index("\n\n")]
    assert "replay_trace.py" not in out and usage.index("--top") < usage.index("--model"), usage
    assert out.index("Where an engine's start and shutdown go") < out.index("\n  --top TOP") < out.index("\nengine:"), out


def test_the_replays_own_lines_name_the_program_run(capsys, monkeypatch):
    """regression (session 38): scheduler/replay.py wrote "replay_trace.py:" into its own lines (the
    replaying line, refusals, "no request completed") whatever the user ran, hicache-replay included."""
    from scheduler.replay import run_cli

    monkeypatch.setattr(sys, "argv", ["hicache-replay"])
    run_cli(["--simulate", "--no-progress", "--max-requests", "2"])
    err = capsys.readouterr().err
    assert "hicache-replay: replaying" in err and "replay_trace.py" not in err, err

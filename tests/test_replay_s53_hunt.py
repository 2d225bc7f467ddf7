"""Regressions from session 53's hunt of the replay driver and the timeline: a --simulate run reports no TTFT
and no request rate (it printed the host's bookkeeping time as both), `python -m scheduler.replay` runs the
replay (it ran nothing and exited 0), and a log file another process writes is refused (two processes sharing
one made one timeline of both, their requests' events merged)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import structlog

from scheduler.logs import configure_logging
from scheduler.replay import format_summary, run_cli

SIM = ["--simulate", "--no-progress", "--max-requests", "20"]


def test_a_simulation_reports_no_ttft_and_no_rate():
    s = run_cli(SIM)
    assert s["completed"] == 20
    assert s["ttft_ms"] == {"p50": None, "p90": None, "p99": None} and s["throughput_req_s"] is None
    table = format_summary(s)
    assert "- / - / -" in table and "- req/s" in table


def test_python_m_scheduler_replay_runs_the_replay():
    ran = subprocess.run([sys.executable, "-m", "scheduler.replay", "--help"], capture_output=True, text=True)
    assert ran.returncode == 0 and "--trace" in ran.stdout
    bad = subprocess.run([sys.executable, "-m", "scheduler.replay", "--bogus-flag"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--bogus-flag" in bad.stderr


def test_a_log_another_process_writes_is_refused(tmp_path):
    path = tmp_path / "run.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from scheduler.logs import configure_logging
        configure_logging({str(path)!r})
        print("ready", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    saved = structlog.get_config()
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(ValueError, match="another process"):
            configure_logging(str(path))
        holder.communicate("", timeout=30)  # (it ends: its lock goes with it)
        configure_logging(str(path))
        configure_logging(str(path))  # (this process again: its own file, as two engines of one process share it)
    finally:
        holder.kill()
        structlog.configure(**saved)
    assert path.read_text().count('"run_start"') == 3

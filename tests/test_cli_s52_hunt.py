"""Regressions from session 52's hunt of the command lines: a replay's --json-out it cannot write is refused before
the run (the replay ran, then lost its summary to a traceback); a temporary L3 file leaves nothing behind however its
process ends (SIGTERM, SIGKILL left GiB in /tmp); the replay's tier sizes given twice are refused (one won, by tier);
the server's --host '' and a port in use are one line before the model loads; a speculative key given is the one
named."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from scheduler import replay, serve
from scheduler.replay_args import SAMPLE_TRACE
from scheduler.speculative import SpeculativeConfig

SHORT = ["--max-requests", "3", "--no-progress", "--time-scale", "0"]


def test_a_json_out_it_cannot_write_is_refused_before_the_replay(capsys):
    with pytest.raises(SystemExit) as stopped:
        replay.run_cli([*SHORT, "--json-out", "/proc/hicache-out.json"])  # (not even root creates files there)
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert "--json-out: cannot write /proc/hicache-out.json" in err and "requests" not in out  # (no replay ran)


def test_a_json_out_that_can_be_written_is_written_and_nothing_is_left_by_the_check(tmp_path):
    path = tmp_path / "out.json"
    replay.run_cli([*SHORT, "--json-out", str(path)])
    assert path.read_text().startswith("{")


@pytest.mark.parametrize("argv, says", [
    (["--l1-tokens", "2048", "--l1-gib", "0.01"], "--l1-tokens and --l1-gib both size L1"),
    (["--l2-tokens", "2048", "--l2-gib", "0.01"], "--l2-tokens and --l2-gib both size L2"),
    (["--l3-tokens", "0", "--l3-gib", "0.01"], "--l3-tokens and --l3-gib both size L3"),
    (["--enable-hicache", "--disable-hicache"], "--enable-hicache and --disable-hicache: give one"),
])
def test_replay_flags_that_contradict_each_other_are_refused(capsys, argv, says):
    with pytest.raises(SystemExit) as stopped:
        replay.run_cli([*SHORT, *argv])
    assert stopped.value.code == 2 and says in capsys.readouterr().err


def test_the_will_fail_line_names_the_flag_that_sized_l1(capsys):
    replay.run_cli(["--trace", str(SAMPLE_TRACE), "--max-requests", "12", "--simulate", "--no-progress",
                    "--model", "qwen3-8b", "--time-scale", "0", "--num-pages", "256"])
    line = next(ln for ln in capsys.readouterr().err.splitlines() if "will fail" in ln)
    assert "(--num-pages 256 sizes it)" in line, line


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_temporary_l3_file_leaves_nothing_however_its_process_ends(tmp_path, how):
    script = textwrap.dedent("""
        import sys, time
        from hicache.storage import FileStore
        from scheduler.presets import PRESETS
        import torch
        store = FileStore(PRESETS["tiny"].kv_geometry(4, torch.float32), 64)
        print("open", flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=os.getcwd())
    try:
        assert child.stdout.readline().strip() == "open"
        child.send_signal(how)
        child.wait(30)
    finally:
        child.kill()
    assert list(tmp_path.iterdir()) == []


def test_the_servers_host_and_port_are_checked_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr(serve, "Engine", lambda config: pytest.fail("the model was built"))
    assert serve.main(["--port", "0", "--model", "tiny", "--device", "cpu", "--host", ""]) == 2
    assert "--host must not be empty" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve.main(["--model", "tiny", "--device", "cpu", "--port", str(port)]) == 2
    assert f"--port {port} on --host 127.0.0.1:" in capsys.readouterr().err
    assert serve.main(["--port", "0", "--model", "tiny", "--device", "cpu", "--log-json", ""]) == 2
    assert "--log-json must not be empty" in capsys.readouterr().err


def test_the_speculative_key_given_is_the_one_named():
    with pytest.raises(ValueError, match="prompt_lookup_max must be an integer >= 1, got 0"):
        SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 0}')
    with pytest.raises(ValueError, match="prompt_lookup_min must be an integer >= 1, got -1"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": -1})

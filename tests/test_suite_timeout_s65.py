"""The suite's own guard against a hung test (pyproject's pytest-timeout settings).

Regression: pytest-timeout's default method (SIGALRM) never fired on a test hung inside uvloop's run (a sync
`generate()` whose request is never admitted, mutloop64's mutant A21; a background response that never ends,
mutresp64's B13): the idle loop waits in C and the signal's Python handler never runs, so a regression of that
kind stalled CI for its whole budget instead of failing one test. The suite now times tests out with a thread."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HUNG = textwrap.dedent('''
    import asyncio

    import uvloop


    def test_hangs_in_an_idle_uvloop():
        async def forever():
            await asyncio.Event().wait()

        uvloop.run(forever())
''')


def test_a_test_hung_in_an_idle_uvloop_fails_instead_of_stalling_the_suite(tmp_path):
    (tmp_path / "test_hung.py").write_text(HUNG)
    # the project's settings, its 300 s limit shortened to 2 s; the guard here is only against a hang of this test
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-c",
           str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-o", "timeout=2", str(tmp_path / "test_hung.py")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "Timeout" in out and "test_hangs_in_an_idle_uvloop" in out, out[-2000:]

"""hicache-serve's exit status once its engine failed: the engine loop crashed (every request since answered 503
`engine_failed`, /health failing), then SIGTERM stopped the server: it exited 0, a clean stop to a supervisor or a
job scheduler, as after a healthy run (the replay exits 1 there). It exits 1 now (scheduler/serve.py `main`; a
shutdown that raises counts as well: scheduler/server.py `_shutdown`); a healthy server's SIGTERM still exits 0
(tests/test_server_lifecycle.py)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import httpx

# the server's command line, its engine's loop made to crash at its first decode batch
_CRASHING = textwrap.dedent("""
    import sys
    from scheduler import admission, serve
    def broken(self, *args, **kwargs):
        raise RuntimeError("injected scheduler bug")
    admission.Admission.decode_batch = broken
    sys.exit(serve.main(sys.argv[1:]))
""")


def test_a_server_whose_engine_loop_crashed_exits_1_at_sigterm(tmp_path):
    cmd = [sys.executable, "-c", _CRASHING, "--model", "tiny", "--device", "cpu", "--port", "0",
           "--shutdown-grace-s", "1", "--disable-access-log"]
    log_path = tmp_path / "server.log"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                cwd=os.path.dirname(os.path.dirname(__file__)))
        try:
            deadline, url = time.monotonic() + 120, None
            while url is None:
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log_path.read_text())
                url = m and m.group(1)
                time.sleep(0.1)
            r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
            assert r.status_code >= 500, r.text
            assert httpx.get(url + "/health", timeout=30).status_code == 503
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 1, log_path.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

"""A server's shutdown and the clients that leave it (scheduler.server): each test starts a server of
its own (tests/test_server.py's ServerThread, or a subprocess for the signal test) on the CPU with
the tiny preset. Shutdown: SIGTERM ends streams within the grace and removes the temporary L3 file;
requests queued when the shutdown starts are served. Clients that leave: mid-stream (the request is
aborted), while their body is read (an abort, not a failure), or stalled mid-upload (holding no
generation slot)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from test_server import GOOD, ServerThread


# -- shutdown -------------------------------------------------------------------------------------------
def test_sigterm_exits_cleanly_within_grace_and_removes_temp_l3(tmp_path):
    grace_s = 1.0
    cmd = [sys.executable, "-m", "scheduler.server", "--model", "tiny", "--device", "cpu", "--port", "0",
           "--enable-hicache", "--max-concurrent-requests", "1", "--shutdown-grace-s", str(grace_s),
           "--disable-access-log"]
    log = open(tmp_path / "server.log", "w+")
    tmpdir = tmp_path / "tmp"  # (the temporary L3 file's directory)
    tmpdir.mkdir()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.path.dirname(os.path.dirname(__file__)),
                            env={**os.environ, "TMPDIR": str(tmpdir)})
    try:
        deadline = time.monotonic() + 60
        url = None
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", (tmp_path / "server.log").read_text())
            url = m and m.group(1)
            time.sleep(0.1)
        path = httpx.get(url + "/hicache/status").json()["storage"]["path"]
        assert path.startswith("/proc/self/fd/") and not list(tmpdir.iterdir())  # (unlinked as it opened)
        with httpx.Client(base_url=url, timeout=30) as c:
            # a long stream occupies the only slot; a second request is refused with 429
            with c.stream("POST", "/v1/completions",
                          json={"prompt": [1, 2, 3], "max_tokens": 4000, "stream": True}) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                busy = httpx.post(url + "/v1/completions", json=GOOD)
                assert busy.status_code == 429 and "--max-concurrent-requests" in busy.json()["error"]["message"]
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]  # the stream ends: aborted after the grace period
            assert any('"code": "aborted"' in line for line in rest) and rest[-1] == "data: [DONE]"
        assert proc.wait(timeout=grace_s + 20) == 0
        assert time.monotonic() - t0 < grace_s + 10
        assert not list(tmpdir.iterdir()), "temporary L3 file left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_requests_queued_at_shutdown_are_served_within_the_grace():
    """Regression: during the shutdown grace the engine admitted no queued request, waited the whole
    grace out, then aborted them (503) though they would have finished in a fraction of it. One long
    request runs (--max-running-requests 1) and two short ones wait when the shutdown starts: all
    three finish, long before the grace ends; a new request is refused."""
    grace_s = 60.0
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=400, max_new_tokens_limit=800,
                                 max_running_requests=1))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=grace_s))) as s:
        def one(i, max_tokens):
            return httpx.post(s.url + "/v1/completions", timeout=120,
                              json={"prompt": [1, 2, 4 + i], "max_tokens": max_tokens, "ignore_eos": True})

        def wait_for(key, n):
            deadline = time.monotonic() + 30
            while (eng := httpx.get(s.url + "/hicache/status").json()["engine"])[key] < n:
                assert time.monotonic() < deadline and not any(f.done() for f in futures), eng
                time.sleep(0.005)
        pool = concurrent.futures.ThreadPoolExecutor(3)
        futures = [pool.submit(one, 0, 700)]
        wait_for("running", 1)
        futures += [pool.submit(one, i, 8) for i in (1, 2)]
        wait_for("waiting", 2)
        t0 = time.monotonic()
        s.call(s.app.state.hc.begin_shutdown)
        refused = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        results = [f.result() for f in futures]
        pool.shutdown()
        assert [r.status_code for r in results] == [200, 200, 200], [r.text[:200] for r in results]
        assert [r.json()["usage"]["completion_tokens"] for r in results] == [700, 8, 8]
        assert refused.status_code == 503
        assert time.monotonic() - t0 < grace_s / 2


# -- clients that leave ---------------------------------------------------------------------------------
def test_a_stream_whose_client_left_is_aborted():
    """On the CPU a token arrives every loop turn, and Starlette's cancellation of the stream never
    landed: the request decoded to max_tokens after its client had gone."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=1100,
                                 max_new_tokens_limit=4000))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        host, port = s.url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": [1, 2, 5], "max_tokens": 4000, "ignore_eos": True, "stream": True}).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            seen = b""
            while b"data: " not in seen:  # the first token arrived; then the client goes away
                seen += sock.recv(65536)
        deadline = time.monotonic() + 60
        while (eng := httpx.get(s.url + "/hicache/status").json()["engine"])["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert eng["aborted"] == 1, eng
        assert eng["decode_tokens"] < 4000, eng


def _outcomes(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in fam.samples:
            if sample.name == "hicache_requests_total":
                out[sample.labels["outcome"]] = sample.value
    return out


def _half_sent_body(url: str) -> socket.socket:
    """A connection that sent a completion's headers and half its body, and nothing more."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": [1, 2,")
    return sock


def test_a_client_that_leaves_while_its_body_is_read_is_an_abort_not_a_failure():
    """Regression: starlette raises ClientDisconnect there, which the handler did not expect: a
    500, an error log with a traceback, and outcome="failed" in the metrics."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, max_new_tokens_limit=16))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        before = _outcomes(s.url)
        sock = _half_sent_body(s.url)
        time.sleep(0.3)  # the handler now waits for the rest of the body
        sock.close()
        deadline = time.monotonic() + 10
        while (after := _outcomes(s.url)).get("aborted", 0) == before.get("aborted", 0):
            assert time.monotonic() < deadline, after
            time.sleep(0.05)
        assert after.get("failed", 0) == before.get("failed", 0)
        assert after["aborted"] == before.get("aborted", 0) + 1
        assert httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}).status_code == 200


def test_a_stalled_upload_holds_no_generation_slot():
    """Regression: the slot of --max-concurrent-requests was taken before the body was read, with no
    time limit on the read: one client stalled mid-upload made every other request a 429."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, max_new_tokens_limit=16))
    with ServerThread(create_app(engine, ServerLimits(max_concurrent_requests=1, shutdown_grace_s=1.0))) as s:
        sock = _half_sent_body(s.url)
        try:
            time.sleep(0.3)
            r = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
        finally:
            sock.close()

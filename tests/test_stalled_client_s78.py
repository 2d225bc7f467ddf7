"""Session 78: hicache-serve's forced exit (a second SIGTERM or Ctrl-C) with a client that reads no more.
Its stream's handler waits for the connection's write buffer to drain (the transport paused writing), which never
happens; `_Server._end_handlers` closed such connections to end their handlers, but a transport's close() waits for
that buffer to flush first: the handler waited on, the forced exit took the whole wait, and the event loop's end then
cancelled the handler, logged "Exception in ASGI application" with a CancelledError traceback. The connections are
now aborted (their buffer dropped): the handler ends, not cancelled.
A single signal, the grace left to run out, did the same a little later: the engine aborted the stream at the grace's
end, its handler still waited to write, and uvicorn cancelled it past its own timeout ("Cancel 1 running task(s)"),
with the same traceback. Once the engine shut down and the grace ran out, such connections are aborted too."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from test_server_signals_s76 import _wait_for

# the server, saying when a connection's transport paused writing (its client read no more: the buffers are full)
_MARKED_SERVER = textwrap.dedent("""
    import sys
    from uvicorn.protocols.http import flow_control
    from scheduler import serve
    pause = flow_control.FlowControl.pause_writing
    def paused(self):
        print("hicache-test: writes paused", flush=True)
        return pause(self)
    flow_control.FlowControl.pause_writing = paused
    sys.exit(serve.main(sys.argv[1:]))
""")
SERVE = ["--model", "tiny", "--device", "cpu", "--port", "0", "--page-size", "16", "--num-pages", "1024",
         "--disable-access-log"]
# every chunk is large (4 choices, 20 logprobs a token, the prompt's echoed in the first): the buffers fill at once
BODY = {"prompt": [5 + i % 200 for i in range(1000)], "max_tokens": 3000, "ignore_eos": True, "stream": True,
        "echo": True, "logprobs": 20, "n": 4}


@pytest.mark.parametrize("forced", [True, False], ids=["second-sigterm", "grace-ran-out"])
def test_a_shutdown_ends_the_stream_of_a_client_that_reads_no_more(tmp_path, forced):
    log_path = tmp_path / "server.log"
    grace_s = "600" if forced else "1"  # (forced: a grace the stream would wait out)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", _MARKED_SERVER, *SERVE, "--shutdown-grace-s", grace_s],
                                stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd())
    client = socket.socket()
    try:
        port = int(_wait_for(log_path, r"Uvicorn running on http://127\.0\.0\.1:(\d+)", proc).group(1))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (a small window: the server's writes pause)
        client.connect(("127.0.0.1", port))
        body = json.dumps(BODY).encode()
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        _wait_for(log_path, "hicache-test: writes paused", proc)  # (the client reads nothing from now on)
        proc.send_signal(signal.SIGTERM)
        if forced:
            _wait_for(log_path, "Waiting for connections to close", proc)  # (the grace: 600 s for the stream)
            proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=90)
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log_path.read_text()
    assert status == 0, out[-3000:]
    assert "Traceback" not in out and "Exception in ASGI application" not in out, out[-5000:]
    assert "timeout graceful shutdown exceeded" not in out, out[-5000:]

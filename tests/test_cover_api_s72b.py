"""hicache-serve's start-up (scheduler/serve.py) where no other in-process test went (session 72's coverage hunt):

- a --host that does not resolve is one line naming it, exit 2, before the model is built;
- the sampling defaults a --generation-config directory sets are said on stderr at start;
- CORS flags given without --allowed-origins are said to be ignored (they do nothing without it);
- --help states a flag's default except where it is None, False or 0 (no "(default: None)" noise);
- SIGINT/SIGTERM: the server's handler starts the app's shutdown (admission stops) and uvicorn's exit; its signal
  handlers are installed only on the main thread, and restored after the run.
(The signal's real end to end, exit 0 after SIGTERM, is test_server_lifecycle's subprocess test.)
"""
from __future__ import annotations

import json
import signal
import socket
import threading

import pytest

from scheduler import serve

BASE = ["--device", "cpu", "--model", "tiny", "--port", "0"]


def _main_without_running(monkeypatch, argv: list[str]) -> serve._Server:
    """serve.main(argv) up to the uvicorn run, which is skipped; the server it would have run."""
    seen = []
    monkeypatch.setattr(serve._Server, "run", lambda self: seen.append(self))
    assert serve.main(argv) == 0
    return seen[0]


def test_a_host_that_does_not_resolve_is_one_line_before_the_model_is_built(capsys, monkeypatch):
    def no_such_host(host, *args, **kwargs):  # (the resolver's answer, without asking a DNS server)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(serve.socket, "getaddrinfo", no_such_host)
    monkeypatch.setattr(serve, "Engine", lambda config: pytest.fail("the model was built"))
    assert serve.main([*BASE, "--host", "no-such-host.invalid"]) == 2
    assert capsys.readouterr().err.strip() == \
        "hicache-serve: --host 'no-such-host.invalid': Name or service not known"


def test_the_sampling_defaults_of_a_generation_config_are_said_at_start(tmp_path, capsys, monkeypatch):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95}))
    server = _main_without_running(monkeypatch, [*BASE, "--generation-config", str(tmp_path)])
    err = capsys.readouterr().err
    assert "sampling defaults from generation_config.json: temperature 0.6, top_p 0.95" in err, err
    assert server.config.app.state.hc.limits.sampling_defaults.describe() in err


def test_cors_flags_without_allowed_origins_are_said_to_be_ignored(capsys, monkeypatch):
    _main_without_running(monkeypatch, [*BASE, "--allowed-methods", '["GET"]', "--allow-credentials"])
    err = capsys.readouterr().err
    assert "ignored without --allowed-origins (no CORS): --allow-credentials, --allowed-methods" in err, err
    _main_without_running(monkeypatch, BASE)  # (none given: nothing said)
    assert "--allowed-origins" not in capsys.readouterr().err


def test_help_states_defaults_but_not_none_false_or_zero():
    text = " ".join(serve.build_parser().format_help().split())  # (argparse wraps lines at the terminal's width)
    for noise in ("(default: None)", "(default: False)", "(default: 0)", "(default: 0.0)"):
        assert noise not in text
    assert "(default: 0.9)" in text and "(default: tiny)" in text
    assert "--enable-hicache" in text and "--disable-access-log" in text  # (switches: their help alone)


def test_a_signal_starts_the_shutdown_and_the_handlers_are_the_servers_only_while_it_runs(monkeypatch):
    server = _main_without_running(monkeypatch, BASE)
    st = server.config.app.state.hc
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with server.capture_signals():
        for sig in before:
            assert signal.getsignal(sig) == server.handle_exit
    assert {sig: signal.getsignal(sig) for sig in before} == before  # (restored; the signal not raised again)
    assert not st.draining and not server.should_exit
    server.handle_exit(signal.SIGTERM, None)
    assert st.draining and server.should_exit  # admission stops at once; uvicorn starts its exit

    installed = []

    def off_main_thread():
        with server.capture_signals():
            installed.append(signal.getsignal(signal.SIGTERM))
    worker = threading.Thread(target=off_main_thread)
    worker.start()
    worker.join(20)
    assert installed == [before[signal.SIGTERM]]  # (signal.signal would raise there: nothing installed)

"""A developer's shell is not CI's (envhunt63): HICACHE_API_KEY or a proxy variable exported there made
every server test that hicache-serve starts in a subprocess (401) or that calls over httpx / the openai client
(through the proxy) fail, and scripts/bench_http.py end in a 401 traceback. conftest.py drops them for the
suite; bench_http sends the key its server inherits and never uses a proxy for its own loopback server."""
from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from scheduler.server import ServerLimits
from server_fixtures import byte_level_server, tiny_config
from test_bench_smoke import load

SHELL_ONLY = ("HICACHE_API_KEY", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def test_the_suite_runs_without_the_shells_key_or_proxy():
    """(Run with HICACHE_API_KEY=k http_proxy=http://127.0.0.1:9 in the environment, this held only after
    conftest.py's clean-up; tests that want a key set it with monkeypatch.)"""
    assert [v for v in SHELL_ONLY if v in os.environ] == []


def test_the_suite_formats_help_at_80_columns_whatever_the_shell():
    """Regression: with COLUMNS=30 exported, test_scripts_s38's help test failed (argparse wrapped the usage line
    after `usage: hicache-replay`); conftest.py fixes the width CI's pipes give."""
    from scheduler.replay_args import build_parser

    assert os.environ["COLUMNS"] == "80"
    parser = build_parser()
    parser.prog = "hicache-replay"
    assert parser.format_usage().startswith("usage: hicache-replay [-h] ")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=8),
                           limits=ServerLimits(api_key="k63", shutdown_grace_s=1.0)) as s:
        yield s


ARGS = SimpleNamespace(new_tokens=2, temperature=0.0, batch=1, rounds=1)


@pytest.mark.parametrize("stream", [True, False])
def test_bench_http_sends_the_key_its_server_inherits(keyed, monkeypatch, stream):
    """Regression: with HICACHE_API_KEY set, the server bench_http starts (inheriting the environment) asked for
    the key, and every call of its client, sent without one, was refused (httpx.HTTPStatusError 401)."""
    monkeypatch.setenv("HICACHE_API_KEY", "k63")
    out = asyncio.run(load("bench_http").over_http(keyed.url, ARGS, iter([[[1, 2, 3]]]), stream=stream))
    assert out["batch_ms"] > 0


def test_bench_http_never_asks_a_proxy_for_its_own_server(keyed, monkeypatch):
    """Regression: with a proxy variable set, the calls to the server on 127.0.0.1 went to the proxy."""
    bench = load("bench_http")
    monkeypatch.setenv("HICACHE_API_KEY", "k63")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # (nothing listens there)
    assert asyncio.run(bench.over_http(keyed.url, ARGS, iter([[[1, 2, 3]]]), stream=True))["batch_ms"] > 0
    asyncio.run(bench.wait_ready(keyed.url, SimpleNamespace(poll=lambda: None), timeout_s=5))

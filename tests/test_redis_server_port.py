"""The tests' throwaway redis-server (tests/redis_server.py) is its own, and their refused URL stays refused.
free_port() probes a port and lets it go, so a server of another pytest-xdist worker may bind it first. Before,
start() took that other server's answer to a ping as its own (two workers' tests then shared and flushed one
server), and a URL meant to be refused could reach that server."""
from __future__ import annotations

import pytest

import redis_server as rs
from redis_server import RedisServer, needs_redis, private_server  # noqa: F401 - fixture


@needs_redis
def test_a_port_taken_between_probe_and_bind_moves_the_server(monkeypatch, private_server):
    taken = iter([private_server.port])
    real = rs.free_port
    monkeypatch.setattr(rs, "free_port", lambda: next(taken, None) or real())
    server = RedisServer().start()
    try:
        assert server.port != private_server.port
        assert server.client().info("server")["process_id"] == server.proc.pid
    finally:
        server.stop()


@needs_redis
def test_a_named_port_held_by_another_server_is_an_error(private_server):
    with pytest.raises(RuntimeError, match=f"port {private_server.port}"):
        RedisServer(port=private_server.port).start()


@needs_redis
def test_the_refused_url_stays_refused():
    """The tests that expect a refused connect use refused_url(): its port stays bound, so no server takes it (a
    free_port() URL could become another worker's server, and the store then reached it)."""
    port = int(rs.refused_url().rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(RuntimeError, match=f"port {port}"):
        RedisServer(port=port).start()
    client = rs.redis.Redis.from_url(rs.refused_url(), socket_timeout=1)
    with pytest.raises(rs.redis.exceptions.ConnectionError):
        client.ping()

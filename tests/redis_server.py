"""A throwaway redis-server on a free loopback port for the Redis tests (skipped without the
binary; .ci/run installs it), and the helpers those tests share."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

from hicache.geometry import KVGeometry

REDIS_SERVER = shutil.which("redis-server")
_SKIP_NO_SERVER = pytest.mark.skipif(REDIS_SERVER is None, reason="no redis-server binary on PATH "
                                     "(apt-get install redis-server; .ci/run installs it)")


def needs_redis(test):
    return pytest.mark.redis(_SKIP_NO_SERVER(test))


redis = pytest.importorskip("redis")

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_REFUSING: list[socket.socket] = []


def refused_url(db: int = 0) -> str:
    """A loopback URL nothing listens on, for the whole test process: its port stays bound and is never
    listened on, so a connect is refused and no other worker's server can take it (free_port's could)."""
    if not _REFUSING:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        _REFUSING.append(sock)
    return f"redis://127.0.0.1:{_REFUSING[0].getsockname()[1]}/{db}"


class RedisServer:
    """A throwaway redis-server on 127.0.0.1 (no persistence). Without a port it takes a free one, and
    another if a server of another test process took that port between the probe and the bind."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        self.own_port = port is None
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    def start(self, attempts: int = 5) -> "RedisServer":
        for _ in range(attempts):
            if self._spawn():
                return self
            if not self.own_port:
                break
            self.port = free_port()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def _spawn(self) -> bool:
        """Start one server on self.port; True once it answers as itself (its process id), False when the
        port was another server's (free_port's probe and the bind race between pytest-xdist workers)."""
        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--protected-mode", "no", *auth], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if self.client().info("server")["process_id"] == self.proc.pid:
                    return True
                break  # another process's server holds the port: ours cannot bind it
            except (redis.exceptions.ConnectionError, redis.exceptions.AuthenticationError,
                    redis.exceptions.ResponseError):
                time.sleep(0.02)
        self.stop()
        return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # like a crash: no shutdown handshake
            self.proc.wait(10)
            self.proc = None

    def url(self, db: int = 0) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0):
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, password=self.password, socket_timeout=5)


@pytest.fixture(scope="session")
def redis_server():
    if REDIS_SERVER is None:
        pytest.skip("no redis-server binary on PATH")
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def server(redis_server):
    """The session's server, emptied."""
    redis_server.client().flushall()
    return redis_server


@pytest.fixture
def private_server():
    """A server of the test's own (its config changes or it gets killed)."""
    if REDIS_SERVER is None:
        pytest.skip("no redis-server binary on PATH")
    s = RedisServer().start()
    yield s
    s.stop()


def random_pages(geometry: KVGeometry, num_pages: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(geometry.page_major_shape(num_pages), generator=gen).to(geometry.dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

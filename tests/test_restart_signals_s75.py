"""A kept L3 file (--hicache-storage-persist) across a server stopped while it starts: the index the engine adopted
(deleted as it was read) must be saved again when SIGTERM (a job scheduler, `timeout`, `kill`) ends the start after
the adoption, before uvicorn handles the signal, as a Ctrl-C there does (session 75: SIGTERM's default killed the
process, and the next start found an empty L3)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

from hicache.l3_index import index_path
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.sigterm import EXIT_STATUS

PROMPT = [(7 * i + 3) % 200 + 5 for i in range(33)]  # 8 whole pages of 4 tokens
FLAGS = ["--model", "tiny", "--device", "cpu", "--num-pages", "48", "--page-size", "4", "--enable-hicache",
         "--hicache-policy", "always", "--hicache-transfer-backend", "torch", "--hicache-storage-persist"]


def _config(path) -> EngineConfig:
    return EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=4).with_hicache(
        enable=True, policy="always", transfer_backend="torch", storage_path=str(path), storage_persist=True)


async def _keep(path) -> int:
    """An engine that served PROMPT and shut down cleanly: the file's index saved; the L3 pages it lists."""
    eng = Engine(_config(path))
    await eng.generate_async([PROMPT], SamplingParams(max_tokens=2))
    await eng.cache.drain()
    await eng.shutdown()
    eng = Engine(_config(path))
    pages = eng.metrics()["storage_adopted_pages"]
    await eng.shutdown()
    return pages


# the server's command line, its SIGTERM sent once the engine was built (its index adopted), before uvicorn runs
_SERVE_TERMINATED = textwrap.dedent("""
    import os, signal, sys
    import scheduler.serve as serve
    build = serve._server
    def terminated_first(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return build(*args, **kwargs)
    serve._server = terminated_first
    sys.exit(serve.main(sys.argv[1:]))
""")


def test_sigterm_while_the_server_starts_keeps_the_index_it_adopted(tmp_path):
    path = tmp_path / "l3.kv"
    kept = asyncio.run(_keep(path))
    assert kept >= 8 and os.path.exists(index_path(str(path)))
    child = subprocess.run([sys.executable, "-c", _SERVE_TERMINATED, *FLAGS, "--hicache-storage-path", str(path),
                            "--port", "0"], capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert child.returncode == EXIT_STATUS != -signal.SIGTERM, (child.returncode, child.stderr[-2000:])
    assert "SIGTERM" in child.stderr and "Traceback" not in child.stderr, child.stderr[-2000:]
    assert os.path.exists(index_path(str(path)))

    async def next_start() -> int:
        eng = Engine(_config(path))
        pages = eng.metrics()["storage_adopted_pages"]
        out = (await eng.generate_async([PROMPT], SamplingParams(max_tokens=2)))[0]
        assert out.cached_tokens.get("l3", 0) >= 32, out.cached_tokens
        eng.cache.check_integrity()
        await eng.shutdown()
        return pages
    assert asyncio.run(next_start()) == kept

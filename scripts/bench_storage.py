"""L3 backends on one machine: page put/get throughput and restore latency through Redis on loopback
versus the local FileStore, for a few page shapes.

    python scripts/bench_storage.py                       # starts its own redis-server on a free port
    python scripts/bench_storage.py --redis-url redis://127.0.0.1:6379/0 --shapes 8b --pages 64

Shapes: `8b` = Qwen3-8B KV pages (36 layers, 8 kv heads, head_dim 128, page 16, bf16: 2.25 MiB a page),
`tiny` = the tiny test preset (2 layers, 2 kv heads, head_dim 16, page 4, float32: 2 KiB a page).
For each backend and shape: `put` writes --pages pages in operations of --op-pages pages (the unit a
backup writes), `get` reads them back the same way (bytes verified once), `restore` times single
reads of --op-pages pages (the S2H step of one restore; median and p90 of --iters), and `hint` times
the existence query of --op-pages keys (Redis only: the refresh that precedes admission).
File reads hit the page cache (the file was just written): the file figures are an upper bound of
the local tier, not a cold disk. Everything runs on one asyncio loop (uvloop), as in the engine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cli import choice_list, positive_int  # noqa: E402

from hicache.geometry import KVGeometry  # noqa: E402
from hicache.storage import FileStore  # noqa: E402

SHAPES = {
    "8b": KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16),
    "tiny": KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32),
}
GIB = float(1 << 30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis() -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("no redis-server on PATH: apt-get install redis-server, or pass --redis-url")
    port = free_port()
    # configured as an L3 should be (hicache/redis_limits.py): evicting least recently used keys past a bound, half
    # this host's memory (regression: the engine warned the benchmark's own server would never evict)
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory", str(host_bytes // 2), "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    proc.kill()
    sys.exit("redis-server did not start")


async def wait(future):
    return await asyncio.wrap_future(future) if not isinstance(future, asyncio.Future) else await future


def open_store(backend: str, geometry: KVGeometry, num_slots: int, url: str | None):
    if backend == "file":
        return FileStore(geometry, num_slots)
    from hicache.storage_redis import RedisStore
    return RedisStore(geometry, num_slots, url, model_id=f"bench:{time.time_ns()}")


async def bench_one(backend: str, shape: str, args, url: str | None) -> dict:
    geometry = SHAPES[shape]
    num_pages, op_pages = args.pages, min(args.op_pages, args.pages)
    store = open_store(backend, geometry, num_pages, url)
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(geometry.page_major_shape(num_pages), generator=gen).to(geometry.dtype)
    dst = torch.zeros_like(src)
    tokens = list(range(num_pages * geometry.page_size))
    ops = [list(range(s, min(num_pages, s + op_pages))) for s in range(0, num_pages, op_pages)]

    def io_kwargs(pages):
        if backend == "file":
            return {}
        ps = geometry.page_size
        return {"keys": store.page_keys(tokens, pages[0] * ps, (pages[-1] + 1) * ps)}

    keys_of = [io_kwargs(p) for p in ops]  # computed outside the timed loops
    t0 = time.perf_counter()
    for pages, kw in zip(ops, keys_of):
        await wait(store.write_pages(src, pages, pages, **kw))
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for pages, kw in zip(ops, keys_of):
        await wait(store.read_pages(pages, dst, pages, **kw))
    get_s = time.perf_counter() - t0
    if not torch.equal(src.view(torch.uint8), dst.view(torch.uint8)):
        raise SystemExit(f"{backend}/{shape}: read back different bytes")
    restore_ms, hint_ms = [], []
    for i in range(args.iters):
        pages, kw = ops[i % len(ops)], keys_of[i % len(ops)]
        t0 = time.perf_counter()
        await wait(store.read_pages(pages, dst, pages, **kw))
        restore_ms.append((time.perf_counter() - t0) * 1e3)
        if backend == "redis":
            t0 = time.perf_counter()
            await store.count_present(kw["keys"])
            hint_ms.append((time.perf_counter() - t0) * 1e3)
    if backend == "redis":
        await store.aclose()
    else:
        store.close()
    total_bytes = num_pages * geometry.bytes_per_page

    def q(values, p):
        return statistics.quantiles(values, n=10)[p // 10 - 1] if len(values) >= 10 else max(values)
    return {
        "backend": backend, "shape": shape, "page_bytes": geometry.bytes_per_page, "pages": num_pages,
        "op_pages": op_pages, "put_gib_s": total_bytes / GIB / put_s, "put_pages_s": num_pages / put_s,
        "get_gib_s": total_bytes / GIB / get_s, "get_pages_s": num_pages / get_s,
        "restore_ms_p50": statistics.median(restore_ms), "restore_ms_p90": q(restore_ms, 90),
        "hint_ms_p50": statistics.median(hint_ms) if hint_ms else None,
    }


def fmt_bytes(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def table(rows: list[dict]) -> str:
    head = ("| backend | shape | page | pages x op | put GiB/s | put pages/s | get GiB/s | get pages/s "
            "| restore p50 / p90 ms | hint query p50 ms |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        hint = f"{r['hint_ms_p50']:.2f}" if r["hint_ms_p50"] is not None else "-"
        lines.append(
            f"| {r['backend']} | {r['shape']} | {fmt_bytes(r['page_bytes'])} | {r['pages']} x {r['op_pages']} "
            f"| {r['put_gib_s']:.3f} | {r['put_pages_s']:,.0f} | {r['get_gib_s']:.3f} | {r['get_pages_s']:,.0f} "
            f"| {r['restore_ms_p50']:.2f} / {r['restore_ms_p90']:.2f} | {hint} |")
    return "\n".join(lines)


async def main_async(args) -> list[dict]:
    # a redis-server only for the redis backend (regression: --backends file needed and started one)
    proc, url = (None, args.redis_url) if args.redis_url or "redis" not in args.backends else start_redis()
    rows = []
    try:
        for shape in args.shapes:
            for backend in args.backends:
                sub = argparse.Namespace(**vars(args))
                if shape == "tiny":  # small pages: many more of them per operation
                    sub.pages, sub.op_pages = args.tiny_pages, args.tiny_op_pages
                rows.append(await bench_one(backend, shape, sub, url))
                print(f"done {backend}/{shape}", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=choice_list(tuple(SHAPES)), default="8b,tiny", help="comma list of 8b, tiny")
    p.add_argument("--backends", type=choice_list(("redis", "file")), default="redis,file",
                   help="comma list of redis, file (a redis-server is started only for redis, without --redis-url)")
    p.add_argument("--pages", type=positive_int, default=64, help="pages written and read per shape (8b)")
    p.add_argument("--op-pages", type=positive_int, default=16,
                   help="pages per operation (8b: 16 pages = 256 tokens)")
    p.add_argument("--tiny-pages", type=positive_int, default=4096)
    p.add_argument("--tiny-op-pages", type=positive_int, default=256)
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--redis-url", default=None, help="use this server instead of starting one")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(os.path.dirname(os.path.abspath(args.json)))):
        p.error(f"--json {args.json}: a file in an existing directory, not a directory")  # (checked before the run)
    try:
        import uvloop
        rows = uvloop.run(main_async(args))
    except ImportError:
        rows = asyncio.run(main_async(args))
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

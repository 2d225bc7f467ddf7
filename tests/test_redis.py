"""Shared L3 on Redis (hicache/storage_redis.py, hicache/page_keys.py): content keys, the store's
page I/O and its failure modes, and engines sharing one Redis — outputs always equal recompute,
failures are counted, and pages of one model never serve another.

Tests that need a server start `redis-server` on a free loopback port (skipped without the binary)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from hicache.geometry import KVGeometry
from hicache.page_keys import PageKeyer, kv_salt, page_keys
from hicache.radix import Tier
from hicache.storage import StorageError
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams

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


class RedisServer:
    """A throwaway redis-server on 127.0.0.1 (no persistence)."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--protected-mode", "no", *auth], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return self
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)

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


# ---- page keys (no server needed) ------------------------------------------------------------------
def _geom(**changes) -> KVGeometry:
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32)
    fields.update(changes)
    return KVGeometry(**fields)


def test_same_prefix_same_model_same_keys():
    salt = kv_salt("tiny:seed0:cpu", GEOM)
    a = list(range(100, 140))
    b = a[:24] + [7] * 16  # shares 6 pages with a
    ka, kb = page_keys(salt, a, 0, 40, 4), page_keys(salt, b, 0, 40, 4)
    assert len(ka) == 10 and len(set(ka)) == 10 and all(len(k) == 32 for k in ka)
    assert ka[:6] == kb[:6] and not set(ka[6:]) & set(kb[6:])
    assert page_keys(kv_salt("tiny:seed0:cpu", _geom()), a, 0, 40, 4) == ka  # a fresh salt, same identity
    assert page_keys(salt, a, 8, 20, 4) == ka[2:5]


@pytest.mark.parametrize("change", [
    {"model_id": "tiny:seed1:cpu"}, {"dtype": torch.bfloat16}, {"page_size": 8}, {"num_layers": 3},
    {"num_kv_heads": 4}, {"head_dim": 32}, {"rank": 1}])
def test_anything_that_changes_kv_bytes_changes_keys(change):
    tokens = list(range(64))
    base = page_keys(kv_salt("tiny:seed0:cpu", _geom()), tokens, 0, 64, 4)
    model_id = change.pop("model_id", "tiny:seed0:cpu")
    rank = change.pop("rank", 0)
    geom = _geom(**change)
    other = page_keys(kv_salt(model_id, geom, rank=rank), tokens, 0, 64, geom.page_size)
    assert not set(base) & set(other)


def test_keys_are_chained():
    salt = kv_salt("m", GEOM)
    tokens = list(range(32))
    keys = page_keys(salt, tokens, 0, 32, 4)
    changed_first = page_keys(salt, [999] + tokens[1:], 0, 32, 4)
    assert not set(keys) & set(changed_first)  # every page depends on token 0
    changed_mid = tokens[:13] + [999] + tokens[14:]  # token 13 is in page 3
    k2 = page_keys(salt, changed_mid, 0, 32, 4)
    assert k2[:3] == keys[:3] and not set(k2[3:]) & set(keys[3:])
    # the same page content at another position (or after another prefix) has another key
    assert page_keys(salt, [1, 2, 3, 4] * 2, 0, 8, 4)[0] != page_keys(salt, [1, 2, 3, 4] * 2, 0, 8, 4)[1]


def test_key_ranges_must_be_page_aligned():
    salt = kv_salt("m", GEOM)
    with pytest.raises(ValueError, match="aligned"):
        page_keys(salt, list(range(16)), 2, 8, 4)
    with pytest.raises(ValueError, match="outside"):
        page_keys(salt, list(range(16)), 0, 20, 4)
    with pytest.raises(ValueError, match="outside"):
        PageKeyer(salt, 4).keys(list(range(16)), 8, 4)


def test_keyer_cache_matches_uncached():
    salt = kv_salt("m", GEOM)
    keyer = PageKeyer(salt, 4, cache_entries=4)
    rng = random.Random(1)
    bases = [[rng.randrange(500) for _ in range(64)] for _ in range(3)]
    for _ in range(200):
        tokens = rng.choice(bases)[: rng.randrange(0, 65)] + [rng.randrange(500)] * rng.randrange(0, 9)
        end = rng.randrange(0, len(tokens) // 4 + 1) * 4
        start = rng.randrange(0, end // 4 + 1) * 4
        assert keyer.keys(tokens, start, end) == page_keys(salt, tokens, start, end, 4)
    assert keyer.hits > 0 and len(keyer._cache) <= 4


# ---- the store ------------------------------------------------------------------------------------
def make_store(url: str, geometry: KVGeometry = GEOM, model_id: str = "test", **kw):
    from hicache.storage_redis import RedisStore
    return RedisStore(geometry, 64, url, model_id=model_id, **kw)


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pages_per_chunk", [1024, 2])
async def test_round_trip_byte_identical(server, dtype, pages_per_chunk):
    geom = _geom(dtype=dtype)
    store = make_store(server.url(), geom)
    store.pages_per_chunk = pages_per_chunk
    src = random_pages(geom, 12, seed=3)
    tokens = list(range(48))
    keys = store.page_keys(tokens, 0, 28)
    assert all(k.startswith(b"hicache:kv:") for k in keys)
    wrote = await store.write_pages(src, [0, 1, 2, 5, 6, 9, 11], [3, 4, 20, 21, 22, 7, 8], keys)
    assert wrote.num_bytes == 7 * geom.bytes_per_page
    assert wrote.num_extents == -(-7 // pages_per_chunk)  # round trips
    dst = torch.zeros_like(src)
    read = await store.read_pages([3, 4, 20, 21, 22, 7, 8], dst, [11, 10, 9, 8, 7, 6, 5], keys)
    assert read.num_bytes == wrote.num_bytes
    for i, h in enumerate([0, 1, 2, 5, 6, 9, 11]):
        assert same_bytes(dst[11 - i], src[h])
    value = server.client().get(keys[0])
    assert len(value) == 16 + geom.bytes_per_page and value[:4] == b"HKV1"
    assert await store.count_present(store.page_keys(tokens, 0, 48)) == 7
    st = store.stats()
    assert st["pages_written"] == st["pages_read"] == 7 and st["errors"] == {}
    await store.aclose()
    with pytest.raises(StorageError) as exc:
        store.read_pages([0], dst, [0], keys[:1])
    assert exc.value.kind == "closed"


@needs_redis
@pytest.mark.asyncio
async def test_missing_key_fails_with_bad_slots(server):
    store = make_store(server.url())
    src = random_pages(GEOM, 4)
    keys = store.page_keys(list(range(16)), 0, 16)
    await store.write_pages(src, [0, 1, 2, 3], [10, 11, 12, 13], keys)
    server.client().delete(keys[2])
    with pytest.raises(StorageError) as exc:
        await store.read_pages([10, 11, 12, 13], torch.zeros_like(src), [0, 1, 2, 3], keys)
    assert exc.value.kind == "missing" and exc.value.bad_slots == (12,)
    assert store.stats()["missing_pages"] == 1 and store.stats()["errors"] == {"missing": 1}
    assert await store.count_present(keys) == 2
    store._script_ok = False  # the EXISTS pipeline (where scripting is refused) agrees
    assert await store.count_present(keys) == 2
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("corruption", ["flip", "truncate", "foreign"])
async def test_corruption_is_detected(server, corruption):
    store = make_store(server.url())
    src = random_pages(GEOM, 3)
    keys = store.page_keys(list(range(12)), 0, 12)
    await store.write_pages(src, [0, 1, 2], [0, 1, 2], keys)
    sync = server.client()
    value = bytearray(sync.get(keys[1]))
    if corruption == "flip":
        value[16 + 100] ^= 0x01
    elif corruption == "truncate":
        del value[-4:]
    else:
        value = bytearray(b"not a page")
    sync.set(keys[1], bytes(value))
    with pytest.raises(StorageError) as exc:
        await store.read_pages([0, 1, 2], torch.zeros_like(src), [0, 1, 2], keys)
    assert exc.value.kind == "checksum" and exc.value.bad_slots == (1,)
    assert not sync.exists(keys[1])  # deleted, so the next writer replaces it
    await store.aclose()


@pytest.mark.asyncio
async def test_unreachable_server_fails_fast_and_counts():
    store = make_store(f"redis://127.0.0.1:{free_port()}/0", backoff_s=(0.2, 0.2))
    src = random_pages(GEOM, 2)
    keys = store.page_keys(list(range(8)), 0, 8)
    for op in range(2):  # the second fails at once: the store backs off a dead server
        t0 = time.monotonic()
        with pytest.raises(StorageError) as exc:
            await store.write_pages(src, [0, 1], [0, 1], keys)
        assert exc.value.kind == "eio" and time.monotonic() - t0 < 3
    assert store.stats()["errors"]["eio"] == 1 and not store.stats()["available"]
    with pytest.raises(StorageError):
        await store.read_pages([0, 1], src, [0, 1], keys)
    await asyncio.sleep(0.25)
    with pytest.raises(StorageError):
        await store.count_present(keys)  # tried again after the back-off
    assert store.stats()["errors"]["eio"] == 2
    with pytest.raises(ValueError):
        make_store("http://example.invalid/")
    await store.aclose()


@needs_redis
@pytest.mark.asyncio
async def test_password_in_url():
    server = RedisServer(password="s3cret").start()
    try:
        store = make_store(server.url())
        src = random_pages(GEOM, 2)
        keys = store.page_keys(list(range(8)), 0, 8)
        await store.write_pages(src, [0, 1], [0, 1], keys)
        assert server.client().exists(*keys) == 2
        assert "s3cret" not in json.dumps(store.stats()) and ":***@" in store.stats()["url"]
        await store.aclose()
        wrong = make_store(server.url().replace("s3cret", "wrong"))
        with pytest.raises(StorageError) as exc:
            await wrong.write_pages(src, [0, 1], [0, 1], keys)
        assert exc.value.kind == "eio"
        await wrong.aclose()
    finally:
        server.stop()


# ---- engines sharing one Redis --------------------------------------------------------------------
VOCAB = 512
RNG = random.Random(7)
BASE = [RNG.randrange(VOCAB) for _ in range(41)]
P1 = BASE + [1, 2, 3]
P2 = BASE + [7, 8, 9, 10]
MAX_TOKENS = 4


def engine_config(url: str, *, seed: int = 0, prefetch: bool = True, num_pages: int = 64) -> EngineConfig:
    return EngineConfig(model="tiny", num_pages=num_pages, page_size=4, seed=seed).with_hicache(
        enable=True, policy="always", storage_backend="redis", storage_url=url, prefetch=prefetch)


_REFERENCE: dict = {}


async def reference(prompts, seed: int = 0) -> list[list[int]]:
    """Outputs of an engine without any cache (recompute)."""
    key = (tuple(map(tuple, prompts)), seed)
    if key not in _REFERENCE:
        eng = Engine(EngineConfig(model="tiny", num_pages=256, page_size=4, seed=seed, enable_prefix_cache=False))
        out = await eng.generate_async(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        await eng.shutdown()
        _REFERENCE[key] = [r.output_ids for r in out]
    return _REFERENCE[key]


async def serve(eng: Engine, prompts) -> list[list[int]]:
    out = await eng.generate_async(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    await eng.stop_loop()  # drains backups: pages are in Redis (or failed) when this returns
    assert all(r.error is None for r in out)
    eng.check_integrity()
    assert eng.cache.l1.allocator.num_private() == 0
    return [r.output_ids for r in out]


async def serve_once(config: EngineConfig, prompts) -> list[list[int]]:
    eng = Engine(config)
    try:
        return await serve(eng, prompts)
    finally:
        await eng.shutdown()


WORKER = r"""
import asyncio, json, sys
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
args = json.loads(sys.argv[1])
sys.stdin.readline()  # imports done; serve when told to (so two instances can import in parallel)

async def main():
    cfg = EngineConfig(model="tiny", num_pages=64, page_size=4, seed=args["seed"]).with_hicache(
        enable=True, policy="always", storage_backend="redis", storage_url=args["url"], prefetch=args["prefetch"])
    eng = Engine(cfg)
    out = await eng.generate_async(args["prompts"], SamplingParams(max_tokens=args["max_tokens"]))
    await eng.stop_loop()  # backups drained: this instance's pages are in Redis
    eng.check_integrity()
    res = {"outputs": [r.output_ids for r in out], "metrics": eng.metrics(), "storage": eng.status()["storage"]}
    await eng.shutdown()
    print("RESULT " + json.dumps(res), flush=True)

asyncio.run(main())
"""


def start_instance(url: str, prompts, *, seed: int = 0, prefetch: bool = True) -> subprocess.Popen:
    """A serving instance in a fresh process; it imports, then waits for serve_instance()."""
    args = json.dumps({"url": url, "prompts": prompts, "seed": seed, "prefetch": prefetch, "max_tokens": MAX_TOKENS})
    return subprocess.Popen([sys.executable, "-c", WORKER, args], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def serve_instance(proc: subprocess.Popen) -> dict:
    try:
        stdout, stderr = proc.communicate("go\n", timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@needs_redis
@pytest.mark.asyncio
async def test_two_processes_share_pages(server):
    url = server.url()
    proc_a = start_instance(url, [P1])
    proc_b = start_instance(url, [P2], prefetch=False)  # without prefetch its hit is counted as L3
    a = serve_instance(proc_a)
    assert a["outputs"] == await reference([P1])
    assert a["storage"]["pages_written"] == len(P1) // 4 and not a["metrics"]["failures"]
    b = serve_instance(proc_b)  # a fresh process: only Redis knows the prefix
    assert b["outputs"] == await reference([P2])
    assert b["metrics"]["hit_tokens"]["l3"] == 40  # BASE's 10 full pages, written by A
    assert b["metrics"]["restores_done"] == 1 and b["storage"]["hint_pages_found"] == 10
    assert not b["metrics"]["failures"]
    c = Engine(engine_config(url))  # with prefetch, the L3 pages are promoted to L2 while queued
    assert await serve(c, [P2]) == await reference([P2])
    hits = c.metrics()["hit_tokens"]
    assert c.metrics()["promotions"] == 1 and hits["l2"] + hits["l3"] == 44  # B wrote P2's last page
    await c.shutdown()


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("prefetch", [True, False])
async def test_keys_deleted_after_hints_fall_back(server, prefetch):
    url, sync = server.url(), server.client()
    assert await serve_once(engine_config(url), [P1]) == await reference([P1])
    b = Engine(engine_config(url, prefetch=prefetch))
    store = b.cache.store
    refresh = store.refresh_hints

    async def refresh_then_flush(mgr, tokens):
        await refresh(mgr, tokens)
        sync.flushdb()  # the hints are in the tree; the pages are gone before anyone reads them

    store.refresh_hints = refresh_then_flush
    assert await serve(b, [P2]) == await reference([P2])
    m = b.metrics()
    assert store.counters["hint_pages_published"] == 10 and m["failures"].get("missing", 0) == 1
    assert m["storage_missing_pages"] >= 1 and m["fallbacks"] >= 1 and m["hit_tokens"]["l3"] == 0
    # the request recomputed, and its write-through put the pages back (under the same keys)
    assert b.cache.match(P2[:-1]).lengths[Tier.L3] == 44
    assert sync.exists(*store.page_keys(P2, 0, 44)) == 11
    await b.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_stale_hints_are_dropped_by_the_next_refresh(server):
    url, sync = server.url(), server.client()
    assert await serve_once(engine_config(url), [P1]) == await reference([P1])
    b = Engine(engine_config(url))
    tokens = P2[:-1]
    await b.cache.refresh_l3_hints(tokens)
    assert b.cache.match(tokens).lengths[Tier.L3] == 40
    keys = b.cache.store.page_keys(tokens, 0, 40)
    sync.delete(*keys[6:])
    await b.cache.refresh_l3_hints(tokens)
    assert b.cache.match(tokens).lengths[Tier.L3] == 24
    assert b.cache.store.counters["stale_hints_dropped"] == 4
    b.check_integrity()
    assert await serve(b, [P2]) == await reference([P2])
    assert not b.metrics()["failures"]
    await b.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_full_redis_noeviction_fails_writes(private_server):
    url, sync = private_server.url(), private_server.client()
    sync.config_set("maxmemory-policy", "noeviction")
    sync.config_set("maxmemory", 1)  # already over: every write is refused with OOM
    a = Engine(engine_config(url))
    assert await serve(a, [P1, P2]) == await reference([P1, P2])
    m = a.metrics()
    assert m["failures"].get("enospc", 0) >= 1 and a.cache.store.errors["enospc"] >= 1
    assert a.cache.match(P1).lengths[Tier.L3] == 0  # nothing that failed was published
    assert sync.dbsize() == 0
    sync.config_set("maxmemory", 0)
    assert await serve(a, [BASE + [5] * 8]) == await reference([BASE + [5] * 8])  # writes work again
    assert sync.dbsize() > 0
    await a.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_lru_eviction_makes_reads_miss(private_server):
    url, sync = private_server.url(), private_server.client()
    assert await serve_once(engine_config(url), [P1]) == await reference([P1])
    b = Engine(engine_config(url, prefetch=False))
    store = b.cache.store
    refresh = store.refresh_hints
    keys = store.page_keys(P2, 0, 40)

    async def refresh_then_fill(mgr, tokens):
        await refresh(mgr, tokens)
        used = sync.info("memory")["used_memory"]
        sync.config_set("maxmemory-policy", "allkeys-lru")
        sync.config_set("maxmemory", used + 200_000)
        for i in range(100):  # newer data pushes the (older) pages out
            sync.set(f"junk:{i}", os.urandom(20_000))
        assert sync.exists(*keys) < len(keys)

    store.refresh_hints = refresh_then_fill
    assert await serve(b, [P2]) == await reference([P2])
    m = b.metrics()
    assert m["failures"].get("missing", 0) == 1 and m["fallbacks"] >= 1 and m["hit_tokens"]["l3"] == 0
    await b.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_redis_stopped_mid_run(private_server):
    url = private_server.url()
    a = Engine(engine_config(url))
    a.cache.store.backoff_s = (0.05, 0.2)
    assert await serve(a, [P1]) == await reference([P1])
    private_server.stop()
    prompts = [BASE[:20] + [3] * 12, [9] * 30]
    assert await serve(a, prompts) == await reference(prompts)  # recomputed; backups to L3 fail
    m = a.metrics()
    assert m["failures"].get("eio", 0) >= 1 or m["failures"].get("hint_refresh", 0) >= 1
    assert a.cache.store.errors["eio"] >= 1
    private_server.start()  # same port, empty: a restarted cache
    await asyncio.sleep(0.25)  # past the back-off
    p3 = [11] * 17 + BASE[:23]
    assert await serve(a, [p3]) == await reference([p3])
    assert private_server.client().dbsize() == 10  # new writes land again
    b = Engine(engine_config(url, prefetch=False))
    assert await serve(b, [p3[:36] + [1, 2]]) == await reference([p3[:36] + [1, 2]])
    assert b.metrics()["hit_tokens"]["l3"] == 36 and not b.metrics()["failures"]
    await a.shutdown()
    await b.shutdown()


@needs_redis
def test_engine_generate_calls_run_on_fresh_loops(server):
    """Engine.generate() runs each call on a new event loop: the store follows with a new client."""
    eng = Engine(engine_config(server.url()))
    prompts = [[P1], [P2], [P1]]
    outs = [eng.generate(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
    ref = Engine(EngineConfig(model="tiny", num_pages=256, page_size=4, enable_prefix_cache=False))
    assert [o[0].output_ids for o in outs] == [ref.generate(p, SamplingParams(max_tokens=MAX_TOKENS))[0].output_ids
                                               for p in prompts]
    st = eng.status()["storage"]
    assert st["errors"] == {} and server.client().dbsize() == 13  # P1's 11 pages, P2's own last 2
    assert st["hint_queries"] == 2 and st["hints_not_needed"] == 1  # P1 again: all in L1, no query
    assert not eng.metrics()["failures"]


@needs_redis
@pytest.mark.asyncio
async def test_other_model_gets_no_hits(server):
    url = server.url()
    assert await serve_once(engine_config(url, seed=0), [P1]) == await reference([P1])
    other = Engine(engine_config(url, seed=1))
    assert await serve(other, [P2]) == await reference([P2], seed=1)
    m = other.metrics()
    assert m["hit_tokens"]["l3"] == m["hit_tokens"]["l2"] == 0 and m["directions"]["s2h"]["count"] == 0
    assert other.cache.store.counters["hint_pages_found"] == 0
    await other.shutdown()

"""vLLM's cache_salt: a salted request shares cached prefixes only with requests of the same salt, in every
tier and in a shared L3's keys; its outputs stay equal to recompute; bad salts are refused by name."""
from __future__ import annotations

import random

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams, salted_prompt
from redis_server import needs_redis, redis_server, server  # noqa: F401

VOCAB = 512


def test_salted_prompt_keys():
    prompt = [5, 6, 7, 8, 9]
    a = salted_prompt(prompt, "tenant-a")
    assert a[1:] == prompt[1:] and a[0] < 0  # no model token is negative: it matches no unsalted prompt
    assert a == salted_prompt(list(prompt), "tenant-a")  # the same salt: the same keys
    assert a[0] != salted_prompt(prompt, "tenant-b")[0]
    assert a[0] != salted_prompt([6] + prompt[1:], "tenant-a")[0]  # the first token still counts
    assert salted_prompt([0], "x")[0] >= -(1 << 62) - 1  # an int64 (a shared L3 hashes tokens as int64)


@pytest.mark.parametrize("salt", ["", 7, b"x"])
def test_bad_salt_is_refused_by_name(salt):
    with pytest.raises(RequestError) as err:
        SamplingParams(cache_salt=salt).validate(64)
    assert err.value.param == "cache_salt"


def workload(seed=0, num_prefixes=3, prefix_len=48):
    """Each base prefix asked under no salt, salt "a" and salt "b", twice each, in a shuffled order."""
    rng = random.Random(seed)
    bases = [[rng.randrange(VOCAB) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    jobs = [(b, salt) for b in range(num_prefixes) for salt in (None, "a", "b") for _ in range(2)]
    rng.shuffle(jobs)
    return [(bases[b] + [rng.randrange(VOCAB)], b, salt) for b, salt in jobs]


def serve_sequentially(engine: Engine, jobs, max_tokens=3):
    import uvloop

    async def go():
        await engine.start()
        out = []
        for prompt, _, salt in jobs:
            out += await engine.generate_async([prompt], SamplingParams(max_tokens=max_tokens, cache_salt=salt))
            await engine.cache.drain()  # (its backups land before the next request: a deterministic replay)
        await engine.stop_loop()
        return out
    return uvloop.run(go())


@pytest.mark.parametrize("tier", ["l1", "l2", "l3"])
def test_salts_share_only_within_a_salt_in_every_tier(tier):
    jobs = workload()
    ref = Engine(EngineConfig(model="tiny", num_pages=1024, page_size=4, enable_prefix_cache=False))
    expected = [r.output_ids for r in ref.generate([p for p, _, _ in jobs], SamplingParams(max_tokens=3))]
    base = EngineConfig(model="tiny", num_pages=1024 if tier == "l1" else 28, page_size=4)
    if tier != "l1":  # L1 holds 2 of the 9 (prefix, salt) pairs, L2 (or L3) all: the others come back from there
        base = base.with_hicache(enable=True, policy="always", host_ratio=8.0 if tier == "l2" else 0.5,
                                 storage_ratio=0.0 if tier == "l2" else 8.0)
    eng = Engine(base)
    out = serve_sequentially(eng, jobs)
    assert [r.output_ids for r in out] == expected  # a salt changes what is cached, never what is computed
    seen = set()
    for (_, b, salt), r in zip(jobs, out):
        hit = sum(r.cached_tokens.values())
        if (b, salt) not in seen:  # the first request of its (prefix, salt): nothing of another salt serves it
            assert hit == 0, (b, salt, r.cached_tokens)
        else:
            assert hit == 48, (b, salt, r.cached_tokens)  # its own salt's pages did, from whichever tier
        seen.add((b, salt))
    hits = eng.metrics()["hit_tokens"]
    if tier != "l1":
        assert hits["l2"] + hits["l3"] > 0
    if tier == "l3":
        assert hits["l3"] > 0
    eng.check_integrity()
    for alloc in eng.cache.tree.allocators.values():
        assert alloc.num_private() == 0


@needs_redis
@pytest.mark.asyncio
async def test_a_shared_l3_keeps_salts_apart(server):
    """Engines sharing one Redis: another instance finds a salted prefix only under the same salt."""
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB) for _ in range(41)]
    cfg = EngineConfig(model="tiny", num_pages=64, page_size=4).with_hicache(
        enable=True, policy="always", storage_backend="redis", storage_url=server.url(), prefetch=False)

    async def serve(salt):
        eng = Engine(cfg)  # a fresh instance each time: only Redis holds the prefix
        try:
            [r] = await eng.generate_async([prompt], SamplingParams(max_tokens=2, cache_salt=salt))
            await eng.stop_loop()  # its backups are in Redis
            eng.check_integrity()
            return r
        finally:
            await eng.shutdown()

    first = await serve("a")
    assert sum(first.cached_tokens.values()) == 0
    for salt in ("b", None):
        other = await serve(salt)
        assert other.cached_tokens["l3"] == 0 and other.output_ids == first.output_ids
    again = await serve("a")
    assert again.cached_tokens["l3"] == 40 and again.output_ids == first.output_ids


# -- over HTTP ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from server_fixtures import byte_level_server, tiny_config
    with byte_level_server(tmp_path_factory, tiny_config()) as s:
        yield s


def cached(srv, path: str, body: dict, salt) -> int:
    """The prompt tokens the prefix cache served one request of `body` under `salt` (None: unsalted)."""
    import httpx
    r = httpx.post(srv.url + path, json={**body, **({} if salt is None else {"cache_salt": salt})}, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    details = usage["input_tokens_details" if path == "/v1/responses" else "prompt_tokens_details"]
    return details["cached_tokens"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a salted prompt, long enough for several pages", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a salted chat, long enough for pages"}],
                              "max_tokens": 2}),
    ("/v1/responses", {"input": "a salted response, long enough for pages", "max_output_tokens": 2})],
    ids=["completions", "chat", "responses"])
def test_the_api_salts_the_cache(srv, path, body):
    a, b = f"tenant-a{path}", f"tenant-b{path}"  # (salts of their own: chats share their template's first pages)
    assert cached(srv, path, body, a) == 0
    assert cached(srv, path, body, b) == 0  # another tenant's prompt is not timed out of the cache
    assert cached(srv, path, body, a) > 0
    if path == "/v1/completions":  # (unsalted chats share the template's first pages with every other test's)
        assert cached(srv, path, body, None) == 0
        assert cached(srv, path, body, None) > 0


@pytest.mark.parametrize("salt", ["", 5, None])
def test_the_api_refuses_a_bad_salt_by_name(srv, salt):
    import httpx
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": salt}, timeout=60)
    if salt is None:  # (null: no salt, as leaving it out)
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text

"""Session 39 hunt in the shutdown's save for other instances (`Engine.shutdown` ->
`Backups.save_for_others`): a shared Redis L3 gets, within what is left of the grace, the pages
of the backups under way and, under write_back, of every unsaved L1 leaf.

Each test bounds its shutdown with `asyncio.wait_for` at several times the grace (a hang fails;
no timing is asserted) and checks the tiers whole afterwards. Pages said saved are checked the
way other instances use them: a second engine restores them and generates what recompute does.
Three failed before their fixes (in `save_for_others`): a second shutdown backed up onto closed
tiers; under write_back with an L2 too small for every leaf at once, the leaves after the first
were skipped (and so the locked-leaf test, which needs rounds too). The rest guard what was found
right: requests and the save sharing the grace, prefetches in flight, Redis stopped, hung or full,
a cancelled shutdown, a local L3 file, the HTTP server's shutdown.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal

import httpx
import pytest
from structlog.testing import capture_logs

from hicache.radix import Tier
from hicache_helpers import assert_whole, read_stream, until
from redis_server import needs_redis, private_server, redis_server, server  # noqa: F401
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.server import ServerLimits, create_app
from test_redis_engine import MAX_TOKENS, VOCAB, reference, serve

BYTES_PER_PAGE = 2048  # (tiny, 4 tokens a page, float32)
PAGES = 11  # a 41-token prompt's full pages once MAX_TOKENS were generated: 44 tokens


def config(url: str, write_policy: str = "write_back", *, l2_pages: int | None = None, **engine) -> EngineConfig:
    """policy "always" (every backup and its L3 write go), prefetch on; an L3 hint table of 256 pages
    (with an L2 of `l2_pages` the default, twice L2, would drop hints of pages the save wrote)."""
    cfg = EngineConfig(model="tiny", num_pages=64, page_size=4, seed=0, **engine)
    extra = {} if l2_pages is None else {"host_size_gb": l2_pages * BYTES_PER_PAGE / (1 << 30),
                                         "storage_size_gb": 256 * BYTES_PER_PAGE / (1 << 30)}
    return cfg.with_hicache(enable=True, policy="always", storage_backend="redis", storage_url=url,
                            prefetch=True, write_policy=write_policy, **extra)


def prompts(tag: str, n: int) -> list[list[int]]:
    rng = random.Random(f"s39-{tag}")  # (prefixes no other test wrote)
    return [[rng.randrange(VOCAB) for _ in range(41)] for _ in range(n)]


async def shut(eng: Engine, grace_s: float) -> None:
    """shutdown(grace_s), failing (not hanging) if it outlives the grace several times over."""
    await asyncio.wait_for(eng.shutdown(grace_s), 4 * grace_s + 5)


def slowed(store, method: str, delay_s: float) -> None:
    """The store's `method` (its `_read` or `_write` coroutine) starts `delay_s` late."""
    run = getattr(store, method)

    async def late(*args):
        await asyncio.sleep(delay_s)
        return await run(*args)

    setattr(store, method, late)


def whole(eng: Engine) -> None:
    eng.check_integrity()
    assert_whole(eng.cache)


async def restored_by_another(url: str, served: list[list[int]], outputs: list[list[int]]) -> dict:
    """A second engine serves each prompt followed by its output (and one more token): it must
    generate what recompute does; returns its metrics (its L3 hits: the pages the first saved)."""
    follow_ups = [p + out[:MAX_TOKENS - 1] + [5] for p, out in zip(served, outputs)]
    second = Engine(config(url, "write_through"))
    try:
        assert await serve(second, follow_ups) == await reference(follow_ups)
        return second.metrics()
    finally:
        await second.shutdown()


@needs_redis
@pytest.mark.asyncio
async def test_a_second_shutdown_backs_up_nothing_onto_closed_tiers(server):
    """Regression: a shutdown without grace closed the tiers leaving write_back's L1 leaves unsaved;
    a second shutdown with a grace backed them up onto the closed tiers: the L3 write raised
    StorageError("closed") out of the backup's driver (an op_driver_error)."""
    eng = Engine(config(server.url()))
    await eng.generate_async(prompts("twice", 1), SamplingParams(max_tokens=MAX_TOKENS))
    await shut(eng, 0)
    assert eng.cache.store.closed
    started = eng.cache.metrics.backups_started
    await shut(eng, 2)
    assert eng.cache.metrics.backups_started == started, "a backup started on closed tiers"
    whole(eng)
    assert server.client().dbsize() == 0


@needs_redis
@pytest.mark.asyncio
async def test_write_back_saves_every_unsaved_leaf_though_l2_holds_one_at_a_time(server):
    """Regression: with an L2 of 16 pages and four 11-page leaves unsaved in L1, the save started a
    backup of each at once; the first held its L2 pages through its L3 write, the other three found
    L2 full of locked pages and were skipped: 11 of 44 pages reached Redis although the grace had
    time for all. The save goes on while a round saves something."""
    ps = prompts("small-l2", 4)
    eng = Engine(config(server.url(), l2_pages=16))
    assert eng.cache.l2.num_pages == 16
    outs = [r.output_ids for r in await eng.generate_async(ps, SamplingParams(max_tokens=MAX_TOKENS))]
    assert outs == await reference(ps)
    assert server.client().dbsize() == 0  # (write_back: nothing left L1 yet)
    await shut(eng, 10)
    whole(eng)
    assert server.client().dbsize() == 4 * PAGES
    assert (await restored_by_another(server.url(), ps, outs))["hit_tokens"]["l3"] == 4 * PAGES * 4


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy,started", [("write_back", True), ("write_through", True), ("write_back", False)])
async def test_requests_running_and_queued_share_the_grace_then_their_pages_are_saved(server, write_policy, started):
    """Three requests, one running at a time, are queued as the shutdown begins (started=False: on
    an engine whose loop never ran, which the shutdown starts for them): they finish within the
    grace, then what is left of it saves their pages; another engine restores them (all hits) and
    generates what recompute does."""
    ps = prompts(f"queued-{write_policy}-{started}", 3)
    eng = Engine(config(server.url(), write_policy, max_running_requests=1))
    if started:
        await eng.start()
    reqs = [eng.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in ps]
    await shut(eng, 20)
    outs = []
    for req in reqs:
        tokens, reason = await read_stream(req)
        assert reason == "length"
        outs.append(tokens)
    assert outs == await reference(ps)
    whole(eng)
    assert server.client().dbsize() == 3 * PAGES
    assert (await restored_by_another(server.url(), ps, outs))["hit_tokens"]["l3"] == 3 * PAGES * 4


@needs_redis
@pytest.mark.asyncio
async def test_a_shutdown_after_stop_loop_saves_write_back_leaves(server):
    """stop_loop() drained (write_back: nothing saved); the shutdown that follows, its loop ended,
    backs the L1 leaves up within its grace."""
    ps = prompts("after-stop", 1)
    eng = Engine(config(server.url()))
    outs = [r.output_ids for r in await eng.generate_async(ps, SamplingParams(max_tokens=MAX_TOKENS))]
    await eng.stop_loop()
    assert server.client().dbsize() == 0
    await shut(eng, 10)
    whole(eng)
    assert server.client().dbsize() == PAGES
    assert (await restored_by_another(server.url(), ps, outs))["hit_tokens"]["l3"] == PAGES * 4


@needs_redis
@pytest.mark.asyncio
async def test_an_engine_whose_loop_never_started_shuts_down_at_once(server):
    """Nothing ran: nothing to save, no warning, the store closed."""
    eng = Engine(config(server.url()))
    with capture_logs() as logs:
        await shut(eng, 5)
    assert not [e for e in logs if e["event"] == "l3_save_timed_out"]
    assert eng.cache.store.closed and eng.cache.metrics.backups_started == 0
    whole(eng)


@needs_redis
@pytest.mark.asyncio
async def test_a_shutdown_with_l3_prefetches_in_flight_ends_whole_with_outputs_of_recompute(server):
    """A first engine wrote a prefix to Redis; a second one, its L3 reads slowed, gets two prompts
    sharing it (the first's prefetch in flight, the second waiting on it) and shuts down at once:
    the requests finish within the grace with recompute's outputs, the save waits for their ops
    and the tiers end whole; the new pages reach Redis."""
    base = prompts("prefetch", 1)[0][:36]
    first = Engine(config(server.url(), "write_through"))
    assert await serve(first, [base + [1, 2, 3, 4, 5]]) == await reference([base + [1, 2, 3, 4, 5]])
    await shut(first, 0)
    written = server.client().dbsize()
    ps = [base + [6, 7, 8, 9, 10], base + [11, 12, 13, 14, 15]]
    eng = Engine(config(server.url()))
    slowed(eng.cache.store, "_read", 0.3)
    await eng.start()
    reqs = [eng.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in ps]
    await until(lambda: eng.cache.runner.pending_counts()["prefetches"] >= 1)
    await shut(eng, 20)
    outs = [(await read_stream(r))[0] for r in reqs]
    assert outs == await reference(ps)
    whole(eng)
    assert eng.metrics()["hit_tokens"]["l2"] + eng.metrics()["hit_tokens"]["l3"] >= 36
    assert server.client().dbsize() == written + 2 * 2  # each prompt's own 2 pages past the shared 9


@needs_redis
@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
async def test_a_shutdown_with_redis_stopped_ends_whole(private_server, write_policy):
    """Redis killed before the shutdown: the save's writes fail at once, the shutdown ends and the
    tiers are whole."""
    eng = Engine(config(private_server.url(), write_policy))
    eng.cache.store.backoff_s = (0.05, 0.2)
    await eng.generate_async(prompts(f"stopped-{write_policy}", 2), SamplingParams(max_tokens=MAX_TOKENS))
    private_server.stop()
    await shut(eng, 2)
    whole(eng)
    assert eng.cache.store.closed


@needs_redis
@pytest.mark.asyncio
async def test_a_shutdown_with_redis_hung_ends_within_grace_and_socket_timeout(private_server):
    """Redis stopped with SIGSTOP (connections accepted, nothing answered) under write_back: the
    save's writes hang, the save times out with its warning, and the cancelling drain waits for
    them only up to the socket timeout (1 s here, past the grace; 5 s by default); the tiers end whole."""
    eng = Engine(config(private_server.url()))
    eng.cache.store._client_kwargs["socket_timeout"] = 1.0  # (before its first client)
    await eng.generate_async(prompts("hung", 1), SamplingParams(max_tokens=MAX_TOKENS))
    os.kill(private_server.proc.pid, signal.SIGSTOP)
    try:
        with capture_logs() as logs:
            await asyncio.wait_for(eng.shutdown(0.3), 0.3 + 1.0 + 3)
    finally:
        os.kill(private_server.proc.pid, signal.SIGCONT)
    assert any(e["event"] == "l3_save_timed_out" for e in logs)
    whole(eng)
    assert eng.cache.store.closed and eng.cache.store.errors.get("eio", 0) == 1


@needs_redis
@pytest.mark.asyncio
async def test_a_shutdown_with_redis_refusing_writes_ends_whole(private_server):
    """Redis full under noeviction (every write refused with OOM): the save ends, the tiers whole."""
    sync = private_server.client()
    sync.config_set("maxmemory-policy", "noeviction")
    sync.config_set("maxmemory", 1)
    eng = Engine(config(private_server.url()))
    await eng.generate_async(prompts("refused", 2), SamplingParams(max_tokens=MAX_TOKENS))
    await shut(eng, 2)
    whole(eng)
    assert sync.dbsize() == 0


@needs_redis
@pytest.mark.asyncio
async def test_a_shutdown_cancelled_during_its_save_still_closes_the_tiers(server):
    """The shutdown's task is cancelled while its save waits for slow L3 writes: the cancellation
    propagates, the cancelling drain still ends every op and the tiers are closed, whole."""
    eng = Engine(config(server.url()))
    slowed(eng.cache.store, "_write", 0.5)
    await eng.generate_async(prompts("cancelled", 1), SamplingParams(max_tokens=MAX_TOKENS))
    task = asyncio.ensure_future(eng.shutdown(20))
    while not eng.cache.runner.live:  # (its save's backup is under way)
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert eng.cache.store.closed and not eng.cache.runner.live
    whole(eng)
    await shut(eng, 1)  # a later attempt ends too


@needs_redis
@pytest.mark.asyncio
async def test_a_locked_l1_leaf_is_skipped_and_the_save_ends(server):
    """Under write_back one unsaved L1 leaf stays locked (a holder the shutdown does not know of):
    the save backs up the others (L2 holding one at a time) and ends; the locked one is not saved."""
    ps = prompts("locked", 3)
    eng = Engine(config(server.url(), l2_pages=16))
    await eng.generate_async(ps, SamplingParams(max_tokens=MAX_TOKENS))
    m = eng.cache.tree.match(ps[0], include_storage=False, touch=False)
    (node,) = m.handles[Tier.L1].children.values()  # the leaf: its generated tokens' page
    eng.cache.lock(node)  # (and its path)
    await shut(eng, 10)
    eng.cache.unlock(node)
    whole(eng)
    assert server.client().dbsize() == 2 * PAGES


@pytest.mark.asyncio
async def test_a_local_file_l3_saves_nothing_at_shutdown(tmp_path):
    """A local L3 file goes with the process: under write_back the shutdown backs nothing up and
    waits for nothing, whatever its grace."""
    cfg = EngineConfig(model="tiny", num_pages=64, page_size=4, seed=0).with_hicache(
        enable=True, policy="always", storage_path=str(tmp_path / "l3.bin"), write_policy="write_back")
    eng = Engine(cfg)
    await eng.generate_async(prompts("file", 1), SamplingParams(max_tokens=MAX_TOKENS))
    assert eng.cache.store is not None and not getattr(eng.cache.store, "content_addressed", False)
    with capture_logs() as logs:
        await shut(eng, 30)
    assert eng.cache.metrics.backups_started == 0
    assert not [e for e in logs if e["event"] == "l3_save_timed_out"]
    whole(eng)


@needs_redis
def test_the_http_servers_shutdown_saves_write_back_leaves(server):
    """The server's lifespan ends with Engine.shutdown(--shutdown-grace-s): a completion served under
    write_back reaches Redis as the server stops, and another engine restores it."""
    from test_server import ServerThread

    ps = prompts("http", 1)
    eng = Engine(config(server.url()))
    with ServerThread(create_app(eng, ServerLimits(shutdown_grace_s=10.0))) as srv:
        reply = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": ps[0], "max_tokens": MAX_TOKENS, "temperature": 0}).json()
        assert server.client().dbsize() == 0
    assert eng.cache.store.closed
    whole(eng)
    assert server.client().dbsize() == PAGES
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    outs = asyncio.run(reference(ps))  # (greedy: what the server generated)
    assert asyncio.run(restored_by_another(server.url(), ps, outs))["hit_tokens"]["l3"] == PAGES * 4


@needs_redis
@pytest.mark.asyncio
async def test_write_through_saves_the_leaves_whose_backups_l2_refused(server):
    """Regression (session 40): under write_through with an L2 of 16 pages, four 11-page prompts
    served at once each start a backup; those that find L2 full of locked pages are refused and their
    pages stay in L1 only. The shutdown's save backed up write_back's unsaved leaves only, so those
    pages never reached the shared L3 although the grace had time for them."""
    ps = prompts("wt-small-l2", 4)
    eng = Engine(config(server.url(), "write_through", l2_pages=16))
    outs = [r.output_ids for r in await eng.generate_async(ps, SamplingParams(max_tokens=MAX_TOKENS))]
    assert outs == await reference(ps)
    await eng.cache.drain()
    assert server.client().dbsize() < 4 * PAGES, "every backup went: the test no longer tests a refusal"
    await shut(eng, 10)
    whole(eng)
    assert server.client().dbsize() == 4 * PAGES
    assert (await restored_by_another(server.url(), ps, outs))["hit_tokens"]["l3"] == 4 * PAGES * 4

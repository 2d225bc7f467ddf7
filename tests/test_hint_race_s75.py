"""A shared L3's hint query answered before this engine's own L3 write of the prefix landed, its reply
seen after (two Redis connections: the query's and the write's; timing hunt, session 75).

Tests start `redis-server` on a free loopback port (skipped without the binary)."""
from __future__ import annotations

import asyncio

import pytest

from hicache.radix import Tier
from redis_server import needs_redis, private_server  # noqa: F401
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from test_redis_engine import P1, engine_config


@needs_redis
@pytest.mark.asyncio
async def test_a_hint_reply_older_than_the_engines_own_write_drops_none_of_its_pages(private_server):
    """Regression: request A's backup wrote its prefix to Redis while the hint query of a longer prompt
    B, sent before that write, was in flight; the query's reply (none of the pages yet) was taken for
    the server having lost them: the 11 hints the write had just published were dropped as stale
    (stale_hints_dropped, exported as such) and B's backup wrote the whole prefix to Redis again."""
    eng = Engine(engine_config(private_server.url()))
    store = eng.cache.store
    store.hint_timeout_s = 30.0  # (the reply is held below)
    write_gate, reply_gate, answered = asyncio.Event(), asyncio.Event(), asyncio.Event()
    real_write, real_count, held = store.write_pages, store.count_present, []

    def write_pages(*args, **kwargs):  # the backup's L3 write reaches the server once write_gate opens
        async def later():
            await write_gate.wait()
            return await real_write(*args, **kwargs)
        return asyncio.ensure_future(later())

    async def count_present(keys):  # B's query: answered by the server now, its reply seen at reply_gate
        found = await real_count(keys)
        if held:
            answered.set()
            await reply_gate.wait()
        return found
    store.write_pages, store.count_present = write_pages, count_present
    await eng.start()
    [a] = await eng.generate_async([P1], SamplingParams(max_tokens=4))  # its backup's L3 write waits
    prefix = P1 + a.output_ids  # (its KV: all but the last token, 11 full pages)
    held.append(True)
    b = eng.add_request(prefix + [5] * 9, SamplingParams(max_tokens=1))  # L1 lacks its last pages: it asks
    await asyncio.wait_for(answered.wait(), 10)  # the server answered: none of its pages yet
    write_gate.set()
    await asyncio.wait_for(eng.cache.drain(), 10)  # A's write landed, its 11 pages hinted in the tree
    full = (len(prefix) - 1) // 4 * 4
    assert eng.cache.tree.match(prefix, touch=False).lengths[Tier.L3] == full == 44
    written = store.counters["pages_written"]
    assert written == 11
    reply_gate.set()
    while not b.state.done:
        await asyncio.sleep(0.01)
    await eng.stop_loop()
    assert store.counters["stale_hints_dropped"] == 0
    # B's backup wrote only its own pages beyond the prefix
    assert store.counters["pages_written"] - written == (len(b.prompt) + len(b.output) - 1) // 4 - 11
    assert private_server.client().exists(*store.page_keys(prefix, 0, full)) == 11
    eng.check_integrity()
    await eng.shutdown()

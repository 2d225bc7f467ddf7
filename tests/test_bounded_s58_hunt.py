"""Session 58's bounded-structures hunt (tiny preset, CPU)."""
from __future__ import annotations

import asyncio
import gc
import random
import time
import tracemalloc

import pytest

from hicache.faults import Fault, FaultInjector
from hicache.radix import Tier
from hicache.storage import FileStore
from scheduler.request import SamplingParams
from test_leak_hunt import VOCAB, assert_idle, make_engine


async def kept_hicache_bytes(bound_bytes: int, within_s: float = 5.0) -> tuple[int, tracemalloc.Snapshot]:
    """The traced bytes hicache/ allocated that are still alive, taken again (for up to `within_s`) while over
    `bound_bytes`: an L3 worker thread holds its finished task's arguments until the OS runs it again, and through
    the failed write's exception (its traceback) the backup driver's frame with the prompt's key and pages (seen
    once in CI on a loaded machine). A leak stays; that thread lets go."""
    give_up_at = time.monotonic() + within_s
    while True:
        gc.collect()
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/hicache/*")])
        kept = sum(s.size for s in snap.statistics("filename"))
        if kept < bound_bytes or time.monotonic() > give_up_at:
            return kept, snap
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
@pytest.mark.parametrize("lagging_io_threads", [False, True])
async def test_write_back_failed_l3_writes_keep_no_prompt_once_the_tree_dropped_it(lagging_io_threads, monkeypatch):
    """Regression: under write_back each failed backup's whole token key went into the op runner's
    `_backup_failed` (the eviction veto's memory), up to 1,024 of them. A backup whose L3 write failed had its
    L2 copy, so the veto (which returns for a node L2 holds before reading it) never took the key out: every
    failed L3 write (EIO, a Redis error) kept a prompt-long tuple for good, after the tree had dropped the prefix
    from every tier: 1,024 x 4,096 tokens at the tiny preset's context, 1,024 x 40,960 (~1.7 GB with their ints)
    at qwen3-8b's. Once the prompts left every tier, the backups' bookkeeping holds (near) no bytes of them.
    lagging_io_threads: each L3 task's thread lingers before it takes the next (a loaded machine's scheduling):
    regression, the test failed once in CI on a thread's transient hold (`kept_hicache_bytes`), not a leak."""
    if lagging_io_threads:
        run_task = FileStore._run_task

        def lagging(self, op, pieces):
            try:
                return run_task(self, op, pieces)
            finally:
                time.sleep(0.1)

        monkeypatch.setattr(FileStore, "_run_task", lagging)
    faults = FaultInjector()
    faults.arm(Fault.EIO_WRITE, times=None)
    eng = make_engine(faults, num_pages=1200, write_policy="write_back")
    await eng.start()
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(1000)] for _ in range(8)]
    tracemalloc.start()
    try:
        for prompt in prompts:
            await eng.generate_async([prompt], SamplingParams(max_tokens=1))
            await eng.cache.drain()
        for tier in (Tier.L1, Tier.L2, Tier.L3):  # the prompts leave every tier
            await eng.cache.flush_async(tier, through_l3=True)
            await eng.cache.drain()
        assert sum(1 for _ in eng.cache.tree.iter_nodes()) == 1  # (the root alone)
        keyer = eng.cache.store.keyer  # (the L3 checksums' prefix keys, session 71: a cache of the last 16 prompts'
        assert len(keyer._cache) <= keyer.cache_entries  # chains, bounded, not the backups' bookkeeping)
        keyer._cache.clear()
        # (8 prompts of 1,000 tokens: 64,000 bytes of tuple alone where their keys are kept)
        kept, snap = await kept_hicache_bytes(16_000)
    finally:
        tracemalloc.stop()
    assert eng.metrics()["failures"].get("eio") == len(prompts)
    assert kept < 16_000, snap.statistics("lineno")[:3]
    await eng.stop_loop()
    assert_idle(eng)
    await eng.shutdown()


def test_an_app_made_and_dropped_keeps_no_engine():
    """Regression: FastAPI keeps every route's function for good in module-level caches (fastapi.dependencies.models,
    4,096 callables), and create_app's routes closed over the engine: each app an in-process user (or a test suite)
    made kept its engine alive after the app and the engine were dropped, with its weights, L1 KV pool and L2 host
    buffer (qwen3-8b: 16 GB of weights on the GPU each). Once the app and the engine are dropped, the engine goes."""
    import weakref

    from scheduler.engine import Engine
    from scheduler.server import ServerLimits, create_app
    from server_fixtures import tiny_config

    engine = Engine(tiny_config())
    app = create_app(engine, ServerLimits())
    assert app.state.hc.engine is engine
    gone = weakref.ref(engine)
    del engine, app
    gc.collect()
    assert gone() is None, "the dropped app's engine is still alive"


def test_a_tokenizer_dropped_is_not_kept_by_the_reasoning_or_request_template_caches(tmp_path):
    """Regression: `think_markers` (an lru_cache of 16) and `request_template` (an lru_cache of 8 on the method, keyed
    by `self`) kept the last 16 and 8 tokenizers alive: ~33 MB each at Qwen3's vocabulary (151,650 tokens: ~530 MB),
    after the servers that loaded them were gone (create_app loads one per app). Each still compiles once."""
    import weakref

    from scheduler.reasoning import think_markers
    from scheduler.tokenizer import HFTokenizer
    from test_server_text import _write_byte_level_tokenizer

    _write_byte_level_tokenizer(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    assert think_markers(tok) is think_markers(tok)
    own = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert tok.request_template(own) is tok.request_template(own)
    gone = weakref.ref(tok)
    del tok
    gc.collect()
    assert gone() is None, "the dropped tokenizer is still alive"

"""Engine foundation: prefix reuse never changes greedy outputs; pages never leak; bad input is
reported per request."""
import asyncio
import contextlib
import random

import pytest

from hicache.radix import Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, RequestState, SamplingParams

VOCAB = 512


def shared_prefix_prompts(seed=0, num_bases=3, base_len=37, num=9, tail=(1, 12)):
    rng = random.Random(seed)
    bases = [[rng.randrange(VOCAB) for _ in range(base_len)] for _ in range(num_bases)]
    return [bases[i % num_bases] + [rng.randrange(VOCAB) for _ in range(rng.randrange(*tail))]
            for i in range(num)]


@pytest.fixture(scope="module")
def reference():
    """Outputs of an engine with no prefix cache and a pool large enough for everything."""
    cache: dict = {}

    def outputs(prompts, max_tokens):
        key = (tuple(map(tuple, prompts)), max_tokens)
        if key not in cache:
            eng = Engine(EngineConfig(model="tiny", num_pages=1024, page_size=4, enable_prefix_cache=False))
            cache[key] = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=max_tokens))]
        return cache[key]
    return outputs


def assert_whole(engine: Engine):
    engine.check_integrity()
    alloc = engine.cache.l1.allocator
    assert alloc.num_private() == 0, "pages still private after every request ended"
    assert alloc.num_free + alloc.num_tree() == alloc.num_pages


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_prefix_reuse_gives_identical_outputs(page_size, reference):
    prompts = shared_prefix_prompts()
    eng = Engine(EngineConfig(model="tiny", num_pages=4096 // page_size, page_size=page_size))
    first = eng.generate(prompts, SamplingParams(max_tokens=6))
    second = eng.generate(prompts, SamplingParams(max_tokens=6))  # everything now in L1
    ref = reference(prompts, 6)
    assert [r.output_ids for r in first] == ref
    assert [r.output_ids for r in second] == ref
    assert sum(r.cached_tokens["l1"] for r in second) > 0
    assert_whole(eng)


def test_chunked_prefill(reference):
    prompts = shared_prefix_prompts(seed=1, base_len=50, num=4)
    eng = Engine(EngineConfig(model="tiny", num_pages=512, page_size=4, max_prefill_tokens=16))
    out = eng.generate(prompts, SamplingParams(max_tokens=5))
    assert [r.output_ids for r in out] == reference(prompts, 5)
    assert eng.stats["batches"] > len(prompts)  # prompts really were split
    assert_whole(eng)


def test_eviction_pressure(reference):
    prompts = shared_prefix_prompts(seed=2, num_bases=6, base_len=40, num=18)
    # 24 pages of 4 tokens: far less than the working set (6 prefixes x ~13 pages)
    eng = Engine(EngineConfig(model="tiny", num_pages=24, page_size=4))
    out = eng.generate(prompts, SamplingParams(max_tokens=4))
    assert [r.output_ids for r in out] == reference(prompts, 4)
    assert eng.cache.metrics.evictions_pages["l1"] > 0
    assert_whole(eng)


def test_sampling_is_seeded():
    prompts = shared_prefix_prompts(num=2)
    eng = Engine(EngineConfig(model="tiny", num_pages=256, page_size=4))
    p = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=123)
    a = eng.generate(prompts, p)
    b = eng.generate(prompts, p)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert_whole(eng)


def test_bad_input_is_per_request(reference):
    eng = Engine(EngineConfig(model="tiny", num_pages=32, page_size=4))
    good = shared_prefix_prompts(num=1)[0]
    bad = [[], [1, 2, VOCAB], [1, -3], [5] * (32 * 4 + 1)]
    out = eng.generate([good] + bad, SamplingParams(max_tokens=3))
    assert out[0].error is None and out[0].output_ids == reference([good], 3)[0]
    assert all(r.error and r.finish_reason == "error" for r in out[1:])
    assert "vocabulary" in out[2].error
    with pytest.raises(RequestError, match="max_tokens"):
        eng.validate(good, SamplingParams(max_tokens=0))
    with pytest.raises(RequestError, match="pool"):
        eng.validate(good, SamplingParams(max_tokens=32 * 4))
    assert_whole(eng)


@pytest.mark.asyncio
@pytest.mark.parametrize("abort_after_events", [0, 1, 3])
async def test_abort_at_any_point_leaks_nothing(abort_after_events, reference):
    prompts = shared_prefix_prompts(seed=3, num=6)
    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4, max_prefill_tokens=24))
    await eng.start()

    async def consume(i, prompt):
        got = []
        async with contextlib.aclosing(eng.submit(prompt, SamplingParams(max_tokens=6))) as stream:
            async for ev in stream:
                if i % 2 == 0 and len(got) >= abort_after_events:
                    break  # closing the stream aborts the request
                if ev.token_id is not None:
                    got.append(ev.token_id)
        return got

    results = await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts)))
    await eng.stop_loop()
    ref = await asyncio.to_thread(reference, prompts, 6)
    for i, got in enumerate(results):
        if i % 2:
            assert got == ref[i]
        else:
            assert got == ref[i][: len(got)]
    assert eng.stats["aborted"] >= 1
    assert_whole(eng)


@pytest.mark.asyncio
async def test_abort_waiting_request():
    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4))
    req = eng.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4))  # loop not started yet
    assert await eng.abort(req.rid)
    ev = await req.queue.get()
    assert ev.finished and ev.finish_reason == "abort"
    assert_whole(eng)


def test_loop_crash_fails_requests_instead_of_hanging(monkeypatch):
    """Regression: a bug inside the loop used to kill its task silently and leave clients waiting."""
    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=4))

    def broken():
        raise RuntimeError("injected scheduler bug")
    monkeypatch.setattr(eng.admission, "decode_batch", broken)
    with pytest.raises(RuntimeError, match="injected"):
        eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4))
    assert eng.stats["failed"] == 1


def test_write_back_waits_for_backups_instead_of_failing(reference):
    """Regression: with write_back, evictions wait for backups; a decode step that cannot get its
    reserved page yet must wait (it used to raise and kill the loop)."""
    prompts = shared_prefix_prompts(seed=4, num_bases=6, base_len=40, num=12)
    eng = Engine(EngineConfig(model="tiny", num_pages=40, page_size=4).with_hicache(
        enable=True, write_policy="write_back", policy="always", storage_ratio=0.0))
    out = eng.generate(prompts, SamplingParams(max_tokens=4))
    assert [r.output_ids for r in out] == reference(prompts, 4)
    assert all(r.error is None for r in out)
    eng.check_integrity()


def test_cuda_graphs_flag_defaults_on():
    """CUDA graphs are the default (CUDA only; the CPU ignores them); --disable-cuda-graphs turns
    them off and the old --enable-cuda-graphs is still accepted."""
    import argparse

    from scheduler.config import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).cuda_graphs is True
    assert config_from_args(parser.parse_args(["--disable-cuda-graphs"])).cuda_graphs is False
    assert config_from_args(parser.parse_args(["--enable-cuda-graphs"])).cuda_graphs is True


def test_validate_names_the_bad_token():
    eng = Engine(EngineConfig(model="tiny", num_pages=32, page_size=4))
    for prompt, bad in (([1, 2, 512], "512"), ([1, True, 3], "True"), ([1, 2.0], "2.0"), ([-1], "-1")):
        with pytest.raises(RequestError, match=bad):
            eng.validate(prompt, SamplingParams(max_tokens=1))


def test_occupancy_is_logged_when_it_moves():
    """Occupancy is a counter for the timeline: one event per tier when its used pages change, not
    one per batch (decode steps that take no new page log none)."""
    from hicache_helpers import capture_op_logs

    eng = Engine(EngineConfig(model="tiny", num_pages=64, page_size=16))
    with capture_op_logs() as logs:
        eng.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=8))  # 12 tokens: one page throughout
    batches = [e for e in logs if e.get("event") == "batch"]
    used = [e["used_pages"] for e in logs if e.get("event") == "occupancy" and e["tier"] == "l1"]
    assert len(batches) == 8 and used and len(used) < len(batches)
    assert all(a != b for a, b in zip(used, used[1:]))


def test_quiet_logging_skips_events_but_capture_and_json_still_get_them(tmp_path):
    """The loop skips building per-step events only when nothing would receive them; capture_logs()
    sees them even after the quiet configuration was installed, and a JSON log gets every one."""
    import json

    import structlog
    from structlog.testing import capture_logs

    from scheduler.logs import configure_logging, info_enabled

    saved = structlog.get_config()
    try:
        configure_logging(None)
        assert not info_enabled()
        with capture_logs() as logs:
            assert info_enabled()
            Engine(EngineConfig(model="tiny", num_pages=64, page_size=16)).generate(
                [[5, 6, 7]], SamplingParams(max_tokens=2))
        assert {"queued", "prefill_start", "finished"} <= {e.get("state") for e in logs}
        path = tmp_path / "log.jsonl"
        Engine(EngineConfig(model="tiny", num_pages=64, page_size=16, log_json=str(path))).generate(
            [[5, 6, 7]], SamplingParams(max_tokens=2))
        events = [json.loads(line)["event"] for line in path.read_text().splitlines()]
        assert events.count("batch") == 2 and "request" in events and "occupancy" in events
    finally:
        structlog.configure(**saved)


def test_admission_does_not_walk_the_tree(monkeypatch):
    """With hundreds of cached prefixes, an L1 hit or a miss that evicts costs no walk over the
    radix tree: evictable pages and eviction candidates are kept as the tree changes (a walk per
    admission made host time grow with the cache: 4.4 ms per hit at 4,000 prefixes). At most the
    rare rebuild of a stale candidate heap walks it."""
    from hicache.radix import RadixTree

    cfg = EngineConfig(model="qwen3-8b", device="cpu", simulate=True, page_size=16, max_total_tokens=300 * 128,
                       max_running_requests=1).with_hicache(enable=True, host_ratio=2.0)
    eng = Engine(cfg)
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000, 100000) for _ in range(112)] for _ in range(300)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    eng.generate([p + [5] for p in prefixes], params)
    walks = []
    real = RadixTree.iter_nodes
    monkeypatch.setattr(RadixTree, "iter_nodes", lambda self: walks.append(1) or real(self))
    hits = [rng.choice(prefixes) + [rng.randrange(1000, 100000)] for _ in range(40)]
    misses = [[rng.randrange(1000, 100000) for _ in range(113)] for _ in range(40)]
    out = eng.generate(hits + misses, params)
    assert all(r.error is None for r in out)
    assert sum(r.cached_tokens.get("l1", 0) > 0 for r in out[:40]) == 40  # the hits hit
    assert len(walks) <= 2
    monkeypatch.undo()
    eng.check_integrity()


def test_gpu_wait_mode_is_validated_and_reaches_the_runner():
    """--gpu-wait {spin,block}: how the loop waits for a forward on CUDA (EngineConfig.gpu_wait)."""
    import argparse

    from scheduler.config import add_engine_args, config_from_args

    with pytest.raises(ValueError, match="gpu_wait"):
        EngineConfig(gpu_wait="sleep")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).gpu_wait == "spin"
    assert config_from_args(parser.parse_args(["--gpu-wait", "block"])).gpu_wait == "block"
    with pytest.raises(SystemExit):
        parser.parse_args(["--gpu-wait", "sleep"])
    assert not Engine(EngineConfig(model="tiny", device="cpu", num_pages=32, gpu_wait="block")).runner.spin_wait
    assert Engine(EngineConfig(model="tiny", device="cpu", num_pages=32)).runner.spin_wait


def test_a_decode_that_cannot_get_its_reserved_page_fails_alone_and_says_why(monkeypatch):
    """L1 promised twice (pages taken behind the admission's back here): a decode step that cannot
    get a reserved page, with nothing pending that would free one, fails that request only, with
    an `l1_overcommit` error event carrying what the promise rested on and a failure counted; the
    engine keeps serving (session 18: one CI run of the server's 200-stream test hit this)."""
    from hicache.radix import Tier
    from hicache_helpers import capture_op_logs

    eng = Engine(EngineConfig(model="tiny", num_pages=32, page_size=4))
    alloc, stolen = eng.cache.l1.allocator, []
    thief = alloc.new_claim("thief")
    decode_batch = eng.admission.decode_batch

    def steal_then_decode():
        if not stolen:  # every page not in a running request's hands
            eng.cache.tree.evict(Tier.L1, alloc.num_pages)
            stolen.extend(alloc.alloc(alloc.num_free, thief))
        return decode_batch()
    monkeypatch.setattr(eng.admission, "decode_batch", steal_then_decode)
    with capture_op_logs() as logs:
        [out] = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=8))  # a new page at token 8
    assert out.error and "no KV page available" in out.error
    [event] = [e for e in logs if e.get("event") == "l1_overcommit"]
    assert event["free_pages"] == 0 and event["evictable_pages"] == 0 and event["request_reserved"] >= 1
    assert eng.cache.metrics.failures == {"l1_overcommit": 1}
    alloc.free(stolen, thief)
    monkeypatch.setattr(eng.admission, "decode_batch", decode_batch)
    [again] = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=8))
    assert again.error is None and len(again.output_ids) == 8
    eng.check_integrity()


async def _finished(req):
    while True:
        ev = await asyncio.wait_for(req.queue.get(), 30)
        if ev.finished:
            return ev


@pytest.mark.asyncio
@pytest.mark.parametrize("concurrent", [False, True], ids=["repeated", "concurrent"])
@pytest.mark.parametrize("hicache", [False, True])
async def test_a_duplicate_publish_does_not_promise_l1_twice(concurrent, hicache):
    """A request whose computed pages the tree already holds (a page-aligned prompt served again,
    whose last page is recomputed; or an identical prompt computed alongside) used to keep its own
    copies and lock the tree's too: pages another request had been admitted on, so a running
    request failed with "no KV page available". Now it switches to the tree's pages and frees its own. (Concurrent
    prompts with shared prefill off: with it on the second waits for the first's pages and computes none twice, and
    this case published no duplicate, session 55's mutation check.)"""
    rng = random.Random(3)
    cfg = EngineConfig(model="tiny", device="cpu", num_pages=24 if concurrent else 10, page_size=4,
                       max_prefill_tokens=40, share_prefill=not concurrent)
    if hicache:
        cfg = cfg.with_hicache(enable=True, policy="always", transfer_backend="torch", storage_ratio=0.0)
    eng = Engine(cfg)
    insert, publish, duplicates = eng.cache.insert_l1, eng.admission._publish, []

    def counted_insert(*args, **kwargs):
        duplicates.extend(got := insert(*args, **kwargs))
        return got

    def checked_publish(req, tokens, backup=True):
        publish(req, tokens, backup)
        held = req.locked_len // 4  # (its pages of the prefix it locks are the tree's: none of its own beside them)
        tree_pages = eng.cache.tree.match(tokens[:req.locked_len], include_storage=False, touch=False).pages
        assert req.pages[:held] == list(tree_pages[Tier.L1]), "a duplicate publish kept its own pages"
    eng.cache.insert_l1, eng.admission._publish = counted_insert, checked_publish
    await eng.start()
    prompt = [rng.randrange(512) for _ in range(33 if concurrent else 8)]
    other = [rng.randrange(512) for _ in range(12 if concurrent else 8)]
    first = eng.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    if not concurrent:
        await _finished(first)
        await eng.cache.drain()
    again = eng.add_request(prompt, SamplingParams(max_tokens=27 if concurrent else 12, ignore_eos=True))
    beside = eng.add_request(other, SamplingParams(max_tokens=24 if concurrent else 12, ignore_eos=True))
    events = [await _finished(r) for r in (first, again, beside)] if concurrent else \
        [await _finished(r) for r in (again, beside)]
    await eng.stop_loop()
    eng.check_integrity()
    await eng.shutdown()
    assert [(e.finish_reason, e.error) for e in events] == [("length", None)] * len(events)
    assert eng.cache.metrics.failures.get("l1_overcommit", 0) == 0
    assert duplicates  # (the case this test is about happened)


@pytest.mark.asyncio
async def test_a_request_failed_for_a_page_wakes_the_loop_for_the_others(monkeypatch):
    """When a decode step fails a request for want of a page (pages taken behind the admission's
    back here) while another request's prefill chunk waits for pages, the failed request's freed
    pages must let the other go on: the loop used to sleep with nothing to wake it."""
    from hicache.radix import Tier

    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=32, page_size=4, max_prefill_tokens=4))
    alloc, stolen = eng.cache.l1.allocator, []
    thief = alloc.new_claim("thief")
    prefill_batch = eng.admission.prefill_batch

    async def steal_then_prefill():
        if not stolen and len(eng.running) == 2 and all(r.cached_len >= 4 for r in eng.running):
            eng.cache.tree.evict(Tier.L1, alloc.num_pages)
            stolen.extend(alloc.alloc(alloc.num_free, thief))
        return await prefill_batch()
    monkeypatch.setattr(eng.admission, "prefill_batch", steal_then_prefill)
    await eng.start()
    decoding = eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    await asyncio.sleep(0)
    chunked = eng.add_request(list(range(20, 36)), SamplingParams(max_tokens=1, ignore_eos=True))
    failed, served = await _finished(decoding), await _finished(chunked)
    await eng.shutdown()
    assert stolen and "no KV page available" in failed.error
    assert (served.finish_reason, served.error) == ("length", None)


def test_a_page_held_for_good_sizes_requests_without_it():
    """On CUDA the graphs' scratch page is held for good: a request that needed the whole pool was
    accepted, could never be admitted, and blocked every request queued behind it."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=12, page_size=16))
    eng.hold_l1_page("test-held")
    assert eng.usable_l1_pages == 11 and eng.max_prompt_tokens == 11 * 16
    with pytest.raises(RequestError, match="needs 12 pages; the L1 pool has 11 pages"):
        eng.add_request(list(range(1, 173)), SamplingParams(max_tokens=20))
    [whole, small] = eng.generate([list(range(1, 173)), [1, 2, 3]], SamplingParams(max_tokens=4))
    assert whole.error is None and small.error is None
    eng.check_integrity()


@pytest.mark.asyncio
async def test_stop_loop_returns_with_requests_still_waiting():
    """stop_loop leaves requests as they are: it hung while one waited, since nothing is admitted
    while stopping and the loop only ended with every queue empty (generate()'s cleanup hung too)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4, max_running_requests=1))
    await eng.start()
    first = eng.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    second = eng.add_request([6, 7, 8, 9, 10], SamplingParams(max_tokens=4, ignore_eos=True))
    await asyncio.sleep(0)
    await asyncio.wait_for(eng.stop_loop(), 30)
    assert first.state is RequestState.FINISHED and second.state is RequestState.WAITING  # running ones end
    await eng.start()  # they go on where they were
    assert (await _finished(second)).finish_reason == "length"
    await eng.shutdown()
    eng.check_integrity()


def test_generate_refuses_params_that_do_not_match_the_prompts():
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4))
    with pytest.raises(ValueError, match="3 prompts but 1 sampling parameters"):
        eng.generate([[1, 2], [3, 4], [5, 6]], [SamplingParams(max_tokens=2)])


def test_a_prompt_of_the_whole_pool_fits_with_one_new_token():
    """The last generated token's K/V is never written: a request needs prompt + max_tokens - 1
    tokens of L1, and a prompt of max_prompt_tokens (the whole pool) used to be refused."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=16, page_size=4))
    assert eng.max_prompt_tokens == 64
    [whole] = eng.generate([list(range(1, 65))], SamplingParams(max_tokens=1))
    [two] = eng.generate([list(range(1, 64))], SamplingParams(max_tokens=2))
    assert whole.error is None and two.error is None and len(two.output_ids) == 2
    with pytest.raises(RequestError, match="needs 17 pages"):
        eng.add_request(list(range(1, 65)), SamplingParams(max_tokens=2))
    eng.check_integrity()


def test_a_request_past_the_models_positions_is_refused():
    """A trace replay served 5,000-token prompts to a model of 4,096 positions without a word."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=2048, page_size=4))
    positions = eng.model_config.max_position_embeddings
    with pytest.raises(RequestError, match=f"exceeds the model's {positions} positions"):
        eng.add_request([1] * positions, SamplingParams(max_tokens=2))
    [last] = eng.generate([[1] * (positions - 1)], SamplingParams(max_tokens=2))  # the last position: fine
    assert last.error is None and len(last.output_ids) == 2


@pytest.mark.asyncio
async def test_a_cancelled_generate_async_aborts_its_requests():
    """Its requests ran to max_tokens with nobody waiting (submit() aborted its own already)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=2048, page_size=4, max_new_tokens_limit=4000))
    task = asyncio.create_task(eng.generate_async([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=4000,
                                                                                         ignore_eos=True)))
    while eng.stats["decode_tokens"] == 0:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert eng.stats["aborted"] == 2 and not eng.running
    await eng.shutdown()
    eng.check_integrity()


def test_requests_back_from_restores_together_keep_their_order():
    """Parked requests whose restores ended in one tick went back to the queue's head in reverse."""
    from types import SimpleNamespace

    from scheduler.request import Request

    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4))
    done = SimpleNamespace(done=True, succeeded=True)
    first, second = (Request(prompt=[1, 2], params=SamplingParams()) for _ in range(2))
    for req in (first, second):
        req.state, req.restore_op = RequestState.PARKED, done
        eng.parked.append(req)
    eng.admission.settle_parked()
    assert list(eng.waiting) == [first, second] and not eng.parked


def test_a_page_held_for_good_never_takes_the_last_one():
    """Engine.hold_l1_page (the CUDA graphs' scratch page) refuses to take an L1's last page with a
    clear error naming the flags: a one-page L1 with graphs used to start and then refuse every
    request for want of a page (the CPU has no graphs; the hold is the same)."""
    one = Engine(EngineConfig(model="tiny", device="cpu", num_pages=1))
    with pytest.raises(ValueError, match=r"--num-pages >= 2 or --disable-cuda-graphs"):
        one.hold_l1_page("cuda-graph-scratch")
    assert one.usable_l1_pages == 1 and one.cache.l1.allocator.num_free == 1  # nothing taken
    two = Engine(EngineConfig(model="tiny", device="cpu", num_pages=2))
    two.hold_l1_page("cuda-graph-scratch")
    assert two.usable_l1_pages == 1
    [out] = two.generate([[1, 2, 3]], SamplingParams(max_tokens=1))  # (a page of 4 tokens: 3 + 1 - 1)
    assert out.error is None

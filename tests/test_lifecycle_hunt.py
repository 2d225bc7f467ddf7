"""The in-process API's lifecycle as a Python user drives it: generate() in and out of event loops,
start/submit/shutdown in every order, two engines in one process, an engine dropped without
shutdown, streams left early, and prompts of the wrong kind. Each must give a clear error or work,
leave nothing queued, and leak no page, thread or temporary file."""
import asyncio
import gc
import glob
import os
import tempfile
import threading
import warnings
import weakref

import numpy as np
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import RequestError, SamplingParams

PAGE = 4
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def make_engine(**kw) -> Engine:
    kw.setdefault("num_pages", 256)
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE, max_new_tokens_limit=1000,
                               **kw).with_hicache(enable=True))


def l3_temp_files() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "hicache-l3-*")))


def assert_nothing_queued(eng: Engine) -> None:
    assert not eng.requests and not eng.waiting and not eng.running and not eng.parked


def assert_whole(eng: Engine) -> None:
    eng.check_integrity()
    alloc = eng.cache.l1.allocator
    assert alloc.num_private() == 0, "pages still private after every request ended"
    assert alloc.num_free + alloc.num_tree() == alloc.num_pages


async def until(predicate, steps: int = 3000) -> None:
    for _ in range(steps):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


# -- generate() and event loops -----------------------------------------------------------------
def test_generate_inside_a_running_loop_says_to_await_generate_async():
    """A Jupyter cell runs inside an event loop: generate() must say what to call instead, and
    leave no coroutine behind that was never awaited (regression: asyncio.run()'s own error, about
    asyncio.run, and a RuntimeWarning for the coroutine generate() had built)."""
    eng = make_engine()

    async def cell():
        with pytest.raises(RuntimeError, match="generate_async"):
            eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        return await eng.generate_async([[1, 2, 3]], SamplingParams(max_tokens=2))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = asyncio.run(cell())
        gc.collect()
    assert len(out[0].output_ids) == 2 and out[0].error is None
    assert_nothing_queued(eng)


def test_a_loop_started_on_another_event_loop_is_refused_not_waited_on_forever():
    """start() ran on an event loop that is not running now (loop.run_until_complete): a submit()
    on a new loop, or generate(), must say so at once (regression: start() took the other loop's
    pending task for its own, the request was queued for a loop that never ran again, and the
    caller waited forever). Once that loop stops the engine there, both work again."""
    eng = make_engine()
    other = asyncio.new_event_loop()
    try:
        other.run_until_complete(eng.start())

        async def first_event():
            async for ev in eng.submit([1, 2, 3], SamplingParams(max_tokens=2)):
                return ev

        async def on_a_new_loop():
            with pytest.raises(RuntimeError, match="another event loop"):
                await asyncio.wait_for(first_event(), 60)
        asyncio.run(on_a_new_loop())
        assert_nothing_queued(eng)

        outcome: list = []

        def call_generate():  # (in a thread only so that a hang fails the test rather than the run)
            try:
                outcome.append(eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2)))
            except BaseException as exc:
                outcome.append(exc)
        worker = threading.Thread(target=call_generate, daemon=True)
        worker.start()
        worker.join(120)
        assert not worker.is_alive(), "generate() waited on a loop that never runs"
        assert isinstance(outcome[0], RuntimeError) and "another event loop" in str(outcome[0])
        assert_nothing_queued(eng)
        assert eng.accepting

        async def stop_here(stop):  # (regression: stop_loop left the engine refusing every request,
            with pytest.raises(RuntimeError, match="another event loop"):  # shutdown closed its tiers)
                await stop()
        asyncio.run(stop_here(eng.stop_loop))
        asyncio.run(stop_here(eng.shutdown))
        assert eng.accepting and not eng.cache.store.closed

        other.run_until_complete(eng.stop_loop())
        out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        assert len(out[0].output_ids) == 2
        other.run_until_complete(eng.shutdown())
    finally:
        other.close()
    assert_whole(eng)


def test_shutdown_on_a_new_loop_after_an_asyncio_run_that_forgot_it():
    """asyncio.run(main) used submit() and ended without shutdown() (it cancelled the engine's loop
    task); asyncio.run(engine.shutdown()) later must close the engine and return (regression: it
    raised CancelledError, as if its caller had been cancelled). stop_loop() too."""
    eng = make_engine()

    async def main():
        async for _ in eng.submit([1, 2, 3, 4, 5], SamplingParams(max_tokens=3)):
            pass
    asyncio.run(main())
    assert eng._loop_task.cancelled()
    asyncio.run(eng.stop_loop())
    asyncio.run(main())
    asyncio.run(eng.shutdown())
    assert eng.cache.store.closed
    assert_nothing_queued(eng)


@pytest.mark.asyncio
async def test_a_timed_out_stop_loop_leaves_the_running_request_to_finish():
    """A stop_loop() cancelled (a wait_for timed out) while a request runs: the loop goes on and the request
    streams to its end (regression: the timeout cancelled the engine's loop task mid-batch; the
    request stayed 'running' forever and its stream never ended), and shutdown() then returns."""
    eng = make_engine()
    await eng.start()
    events = []

    async def consume():
        async for ev in eng.submit([1, 2, 3, 4, 5], LONG):
            events.append(ev)
    consumer = asyncio.create_task(consume())
    await until(lambda: eng.stats["decode_tokens"] >= 3)
    stop = asyncio.create_task(eng.stop_loop())  # (as wait_for does when its time is up:)
    await asyncio.sleep(0)
    assert eng.stopping and eng.running, "stop_loop() had not begun to wait for the running request"
    stop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stop
    done, _ = await asyncio.wait([consumer], timeout=300)
    assert done, f"the stream stalled after {len(events)} events"
    assert events[-1].finished and events[-1].finish_reason == "length" and len(events) == LONG.max_tokens + 1
    await eng.shutdown()
    assert_whole(eng)


def test_generate_twice_and_then_the_async_api_on_a_new_loop():
    eng = make_engine()
    first = eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4))
    second = eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4))
    assert first[0].output_ids == second[0].output_ids and second[0].cached_tokens["l1"] > 0

    async def stream():
        await eng.start()
        await eng.start()  # a second start is a no-op
        got = [ev.token_id async for ev in eng.submit([1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
               if ev.token_id is not None]
        await eng.shutdown()
        await eng.shutdown()  # and so is a second shutdown
        return got
    assert asyncio.run(stream()) == first[0].output_ids
    assert_whole(eng)


# -- bad input is per request, and leaves nothing queued ----------------------------------------
def test_a_bad_sampling_params_in_a_batch_fails_that_prompt_alone_and_queues_nothing():
    """generate() with one entry that is not a SamplingParams (a dict): that prompt gets an error,
    the others their tokens (regression: an AttributeError escaped generate() and the prompts before
    it stayed queued, to run, unseen, in the next call)."""
    eng = make_engine()
    out = eng.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]],
                       [SamplingParams(max_tokens=2), {"max_tokens": 2}, SamplingParams(max_tokens=3)])
    assert out[1].finish_reason == "error" and "SamplingParams" in out[1].error
    assert len(out[0].output_ids) == 2 and len(out[2].output_ids) == 3
    assert_nothing_queued(eng)
    assert_whole(eng)

    async def submit_a_dict():
        with pytest.raises(RequestError, match="SamplingParams"):
            async for _ in eng.submit([1, 2, 3], {"max_tokens": 2}):
                pass
        await eng.stop_loop()
    asyncio.run(submit_a_dict())
    assert_nothing_queued(eng)


def test_a_failure_while_queueing_a_batch_unqueues_the_prompts_before_it(monkeypatch):
    """Anything but a RequestError raised while generate() queues its prompts (here the prefetch
    check of the third) propagates; the prompts already queued must not stay behind (regression:
    they ran in the next generate() call, which waited for them)."""
    eng = make_engine()
    calls = []
    real = eng.admission.maybe_prefetch

    def third_fails(req):
        calls.append(req)
        if len(calls) == 3:
            raise OSError("injected")
        return real(req)
    monkeypatch.setattr(eng.admission, "maybe_prefetch", third_fails)
    with pytest.raises(OSError, match="injected"):
        eng.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], LONG)
    assert_nothing_queued(eng)
    monkeypatch.undo()
    out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert eng.stats["decode_tokens"] + eng.stats["prefill_tokens"] < 50, "the abandoned prompts ran"
    assert len(out[0].output_ids) == 2
    assert_whole(eng)


@pytest.mark.parametrize("prompt, says", [
    ([np.int64(1), np.int64(2)], "int"),
    (list(np.array([1, 2, 3])), "int"),
    ([True, 2], "bool"),
    ([1.0, 2.0], "float"),
    (np.array([1, 2, 3]), "tolist"),
    ((t for t in [1, 2]), "list"),
])
def test_a_prompt_of_the_wrong_type_is_told_so_not_that_its_ids_are_out_of_range(prompt, says):
    """Token ids of the right values but the wrong type (numpy ints, bools, floats) or a prompt that
    is an array or a generator: the error names the type (regression: 'token id np.int64(1) is
    outside the vocabulary [0, 512)', which it is not)."""
    eng = make_engine()
    with pytest.raises(RequestError) as info:
        eng.validate(prompt, SamplingParams(max_tokens=2))
    assert says in str(info.value) and "outside the vocabulary" not in str(info.value)


def test_ids_outside_the_vocabulary_empty_and_overlong_prompts_are_per_request_errors():
    eng = make_engine(num_pages=16)
    vocab = eng.vocab_size
    bad = [[], [1, vocab], [1, -1], [3] * (16 * PAGE + 1)]
    out = eng.generate([[1, 2, 3]] + bad + [(4, 5, 6)], SamplingParams(max_tokens=2))
    assert out[0].error is None and out[-1].error is None  # (a tuple is a prompt too)
    assert [r.finish_reason for r in out[1:-1]] == ["error"] * 4
    assert "non-empty" in out[1].error and "vocabulary" in out[2].error and "vocabulary" in out[3].error
    assert "exceeds" in out[4].error
    assert_nothing_queued(eng)
    assert_whole(eng)


# -- the async API ------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_every_way_a_consumer_leaves_a_stream_aborts_it_and_frees_its_pages():
    """An exception in the consumer's loop body, a wait_for timeout around the next event, and an
    explicit aclose(): each request ends aborted (not after its 400 tokens) and every page is back."""
    eng = make_engine()
    await eng.start()
    with pytest.raises(KeyError):
        async for ev in eng.submit([1, 2, 3, 4, 5], LONG):
            if ev.index >= 2:
                raise KeyError("consumer bug")
    stream = eng.submit([6, 7, 8, 9], LONG)
    await stream.__anext__()
    with pytest.raises(asyncio.TimeoutError):
        while True:
            await asyncio.wait_for(stream.__anext__(), timeout=0)
    stream = eng.submit([10, 11, 12], LONG)
    await stream.__anext__()
    await stream.aclose()
    await until(lambda: not eng.requests)
    assert eng.stats["aborted"] == 3 and eng.stats["finished"] == 0
    assert eng.stats["decode_tokens"] < 3 * 400
    await eng.stop_loop()
    assert_whole(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_duplicate_ids_status_while_running_and_everything_after_shutdown():
    eng = make_engine()
    await eng.start()
    first = eng.submit([1, 2, 3], LONG, rid="same")
    await first.__anext__()
    with pytest.raises(RequestError, match="duplicate"):
        async for _ in eng.submit([4, 5, 6], LONG, rid="same"):
            pass
    status = eng.status()
    assert status["engine"]["running"] == 1 and list(eng.requests) == ["same"]
    assert eng.metrics()["hit_tokens"] is not None
    await first.aclose()
    await eng.shutdown()
    assert eng.status()["engine"]["aborted"] == 1 and eng.metrics()
    eng.check_integrity()
    with pytest.raises(RequestError, match="has shut down"):
        async for _ in eng.submit([1, 2, 3]):
            pass
    await eng.start()  # a no-op: a shut-down engine stays down
    assert eng._loop_task is None
    assert_nothing_queued(eng)
    await eng.shutdown()


@pytest.mark.asyncio
async def test_shutdown_without_start_ends_requests_queued_before_it():
    eng = make_engine()
    req = eng.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    await eng.shutdown()
    ev = await req.queue.get()
    assert ev.finished and ev.finish_reason == "abort"
    assert_nothing_queued(eng)
    assert eng.cache.store.closed


# -- engines in one process ---------------------------------------------------------------------
def test_two_engines_keep_their_own_l3_files_and_a_dropped_one_leaves_no_file_or_thread():
    """Two engines side by side give the same tokens from separate L3 temp files; one dropped
    without shutdown() (after generate(), or after an asyncio.run that forgot it) is collected, its
    file closed (unlinked as it opened: never in the temporary directory) and its I/O threads gone, with no
    ResourceWarning."""
    before_threads = set(threading.enumerate())
    before_files = l3_temp_files()
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, b = make_engine(), make_engine()
        paths += [a.cache.store.path, b.cache.store.path]
        assert paths[0] != paths[1]
        ra = a.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], SamplingParams(max_tokens=4))
        rb = b.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], SamplingParams(max_tokens=4))
        assert ra[0].output_ids == rb[0].output_ids
        assert all(p.startswith("/proc/self/fd/") for p in paths) and l3_temp_files() <= before_files

        async def forgot_shutdown():
            eng = make_engine()
            paths.append(eng.cache.store.path)
            async for _ in eng.submit([1, 2, 3], SamplingParams(max_tokens=3)):
                pass
            return weakref.ref(eng)
        refs = [weakref.ref(a), weakref.ref(b), asyncio.run(forgot_shutdown())]
        del a, b
        gc.collect()
    assert all(r() is None for r in refs), "an engine dropped without shutdown() was never collected"
    assert not set(paths) & l3_temp_files()
    left = [t for t in set(threading.enumerate()) - before_threads if t.name.startswith("hicache")]
    for t in left:
        t.join(30)
    assert not [t.name for t in left if t.is_alive()]

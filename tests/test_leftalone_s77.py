"""Session 77's left-alone list, confirmed and fixed (tiny preset, CPU):
- scheduler/admission.py `after_step`: a request admitted earlier in a prefill pass, which then waited for a later
  request's blocking restore (--disable-hicache-prefetch), and aborted during that wait (abort() returned True), was
  still prefilled and sent its first token to its client after the abort (session 74 fixed the one queued behind).
- scheduler/serve.py `_start`: a SIGTERM or Ctrl-C (or a raise) while the app was built, past the engine, closed the
  engine's tiers but not its --log-json log: main() run in-process (tests, an embedding program) returned 143/130 with
  the file still open and locked, and structlog still writing into it (a later engine without a log wrote there).
- scheduler/replay.py `replay_async`: cancelled (a caller's timeout or cancel; the CLI's SIGTERM), it shut its engine
  down but left its driver task running: it slept to each later arrival of the trace (hours, timed) and submitted
  every remaining request to the shut-down engine."""
from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from hicache.radix import Tier
from hicache_helpers import ReadGate, until
from scheduler.logs import configure_logging
from scheduler.request import RequestState, SamplingParams
from test_pressure_hunt import PAGE, WAIT_S, assert_all_free, ended, make_engine, prompt_of
from test_log_refused_s76 import _locked_by_this_process
from test_prefix_edges_hunt import reference
from server_fixtures import tiny_config


@pytest.mark.asyncio
async def test_a_request_admitted_before_anothers_blocking_restore_and_aborted_during_it_sends_no_token():
    """C is admitted first in the pass (nothing to restore); A, behind it, waits for its L3 read, and the loop with
    it. C is aborted meanwhile: abort() returns True. Once A's read landed, the pass's batch ran with C in it: C's
    client got a token after its abort."""
    rng = random.Random(7)
    prefix = prompt_of(rng, 6 * PAGE)
    eng = make_engine(num_pages=64, prefetch=False)
    await eng.start()
    await asyncio.wait_for(eng.generate_async([prefix + [1]], [SamplingParams(max_tokens=2)]), WAIT_S)
    await eng.cache.drain()
    eng.cache.flush(Tier.L1)
    eng.cache.flush(Tier.L2)
    assert eng.cache.tree.match(prefix, touch=False).lengths == [0, 0, len(prefix)]
    gate = ReadGate(eng.cache.store)
    params = SamplingParams(max_tokens=4)
    c = eng.add_request(prompt_of(rng, 9), params)  # admitted first in the pass
    a = eng.add_request(prefix + [2], params)  # its blocking restore: the pass waits for it
    await until(lambda: a.state is RequestState.PARKED)
    assert c.state is RequestState.PREFILL  # (admitted before the wait: in the pass's batch)
    assert await eng.abort(c.rid)
    gate.release()
    await ended(a)
    await ended(c)
    assert c.finish_reason == "abort" and c.output == [], f"a token after abort(): {c.output}"
    assert a.finish_reason == "length" and a.output == (await reference([prefix + [2]], 4))[0]
    await assert_all_free(eng)
    await eng.shutdown()


# -- hicache-serve interrupted after its engine was built ----------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_interrupted_while_its_app_is_built_lets_its_log_go(tmp_path, monkeypatch, capsys, sig):
    from scheduler import serve
    from scheduler.engine import Engine

    log = tmp_path / "serve.jsonl"
    create_app = serve.create_app

    def signal_then_create_app(*args, **kwargs):  # (past the engine: its log open)
        os.kill(os.getpid(), sig)
        return create_app(*args, **kwargs)

    monkeypatch.setattr(serve, "create_app", signal_then_create_app)
    monkeypatch.setattr(serve._Server, "run", lambda self: pytest.fail("the server ran on past the signal"))
    configure_logging(None)
    try:
        status = serve.main(["--model", "tiny", "--device", "cpu", "--port", "0", "--num-pages", "64",
                             "--log-json", str(log)])
        assert status == 128 + sig, capsys.readouterr().err
        assert not _locked_by_this_process(log), "the engine's log stays open and locked after main() returned"
        lines = log.read_text().splitlines()
        engine = Engine(tiny_config(num_pages=64))  # (no log of its own)
        engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2))
        assert log.read_text().splitlines() == lines, "a later engine without a log wrote into the served one's"
    finally:
        configure_logging(None)


# -- a replay cancelled by its caller ------------------------------------------------------------------
@pytest.mark.parametrize("concurrency", [1, 2])
@pytest.mark.asyncio
async def test_a_cancelled_replay_leaves_no_task_running(concurrency):
    from scheduler.config import EngineConfig
    from scheduler.replay import ReplayItem, replay_async

    # (the second request arrives an hour later, timed: the driver sleeps till then)
    items = [ReplayItem(0, 1, 0.0, [1] * 8, 64), ReplayItem(1, 2, 3600.0, [2] * 8, 4)]
    replay = asyncio.get_running_loop().create_task(
        replay_async(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64), items,
                     time_scale=1.0, concurrency=concurrency))
    mine = asyncio.all_tasks() - {replay}
    await until(lambda: any(t.get_coro().__name__ == "_dispatch" for t in asyncio.all_tasks()), WAIT_S)
    replay.cancel()
    with pytest.raises(asyncio.CancelledError):
        await replay
    left = [t for t in asyncio.all_tasks() - mine if not t.done()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
    assert not left, f"the cancelled replay left these running: {left}"


"""Session 71's raise hunt of the engine's loop and the replay's command line: what an interrupt, an odd trace or a
raising cost model does to a run. Pinned here:
- Ctrl-C mid-replay: asyncio's runner cancelled the run (its engine shut down, a kept L3's index saved, as at SIGTERM)
  and then raised KeyboardInterrupt out of the command: a traceback. Now exit status 130 and one line on stderr, as
  for a Ctrl-C while the trace is read;
- a trace whose arrivals are more than an hour apart (a timestamp of 1e12 ms, a jump of days): a timed replay slept
  that long in silence. Now one line before the replay names the line and the wait, and --time-scale 0;
- a KeyboardInterrupt (or SystemExit) raised in the engine's loop task left its live requests listed as running or
  queued with nobody reading them: the next loop ran them to their end for no one, and a caller that caught the
  interrupt and read on waited forever. Now they end aborted as the interrupt goes out, as a crash fails them;
- replay_async awaited on a program's own event loop replaced the SIGTERM handler that program had set on that loop,
  and after the run left SIGTERM ignored (asyncio's no-op handler, no callback). Now only the command's own loop
  (replay()) takes SIGTERM;
- the cost model raising as it admits a write (worth_writing, backup_worth_its_cost, backup_pays_off): out of
  write_through_selective's backup at a hit or write_back's eviction veto it crashed the engine loop (every live
  request failed, generate() raised); out of the backups started after a step, asyncio's handler printed it and the
  failure went uncounted. Now the write is refused, counted as failures.cost_model, as a failed `decide` is."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import signal

import pytest

from hicache_helpers import assert_whole
from scheduler import replay, runner
from scheduler.config import EngineConfig
from scheduler.request import RequestState, SamplingParams
from test_faults import OTHER, PROMPT, make_engine, reference
from test_lifecycle_hunt import assert_nothing_queued
from test_raise_cancel_s70 import LONG, serves_on
from test_raise_cli_s70 import SHORT, adopted_pages, persisted

HANG_GUARD_S = 20  # a caller with no last event by then would wait forever


# -- Ctrl-C mid-replay ----------------------------------------------------------------------------
def test_ctrl_c_mid_replay_exits_130_with_one_line_and_the_engine_shut_down(tmp_path, monkeypatch, capsys):
    """SIGINT arrives at the 20th forward (the shell's Ctrl-C): exit status 130 and one line, no traceback; the engine
    shut down first (its L3 index saved, the file unlocked: the next run adopts it)."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (asyncio's runner takes it only then)
    launch, calls = runner.ModelRunner.launch, []

    def launch_then_sigint(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 20:
            os.kill(os.getpid(), signal.SIGINT)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(runner.ModelRunner, "launch", launch_then_sigint)
    try:
        with pytest.raises(SystemExit) as stopped:
            replay.main([*SHORT, *persisted(tmp_path)])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended the replay with a KeyboardInterrupt's traceback")
    assert stopped.value.code == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C): the engine shut down, its tiers closed; no summary" in err and "Traceback" not in err
    assert (tmp_path / "l3.index").exists(), "the engine was not shut down: its adopted index is lost"
    monkeypatch.setattr(runner.ModelRunner, "launch", launch)
    assert adopted_pages(tmp_path) > 0


def test_ctrl_c_while_the_trace_is_read_exits_130_with_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C before the run (a large trace being read): no engine yet, exit status 130 and one line, no traceback."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(replay, "load_trace", interrupted)
    try:
        assert replay.main(SHORT) == 128 + signal.SIGINT
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while the trace was read ended the replay with a KeyboardInterrupt's traceback")
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C); no summary" in err and "Traceback" not in err


# -- a trace's long waits -------------------------------------------------------------------------
class Replayed(Exception):
    """Raised where the replay would start: what came before it is all the test looks at (nothing sleeps)."""


def trace_of(tmp_path, timestamps: list[float]):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": 20, "output_length": 2, "hash_ids": [i]})
                            + "\n" for i, ts in enumerate(timestamps)))
    return path


@pytest.mark.parametrize("time_scale", ["1", "0.5"])
def test_a_wait_of_years_between_arrivals_is_said_before_the_replay(tmp_path, monkeypatch, capsys, time_scale):
    """Line 3's timestamp is 1e12 ms (31 years after line 2's): a timed replay says so, naming the line, before it
    starts; at --time-scale 0 (no waits) it says nothing."""
    def replayed(*args, **kwargs):
        raise Replayed

    monkeypatch.setattr(replay, "replay", replayed)
    trace = trace_of(tmp_path, [0, 1000, 1e12, 1e12 + 500])
    argv = ["--trace", str(trace), "--device", "cpu", "--block-tokens", "16", "--l1-tokens", "4096", "--l3-tokens",
            "0", "--no-progress", "--time-scale"]
    with pytest.raises(Replayed):
        replay.run_cli([*argv, time_scale])
    err = capsys.readouterr().err
    hours = f"{(1e12 - 1000) / 1000 * float(time_scale) / 3600:,.1f} h"
    assert f"{trace}:3: arrives {hours} after the request before it at --time-scale {time_scale}" in err, err
    assert "--time-scale 0 replays as fast as possible" in err
    with pytest.raises(Replayed):
        replay.run_cli([*argv, "0"])
    assert "arrives" not in capsys.readouterr().err


# -- an interrupt in the engine's loop ------------------------------------------------------------
def interrupted_run(monkeypatch, eng, prompts, interrupt, at_step: int, before_reading=None) -> list:
    """asyncio.run(main): queue `prompts` (LONG) and read their streams, one after another, as the replay does with
    add_request; `interrupt` is raised in the loop at its `at_step`-th after_step and goes out of asyncio.run.
    before_reading(reqs): called once they are queued. -> the requests (the monkeypatches undone)."""
    after_step, steps, reqs = eng.admission.after_step, [], []

    def interrupted(req, *args, **kwargs):
        steps.append(req.rid)
        if len(steps) == at_step:
            raise interrupt
        return after_step(req, *args, **kwargs)
    monkeypatch.setattr(eng.admission, "after_step", interrupted)

    async def read(req) -> None:
        while not (await req.queue.get()).finished:
            pass

    async def main() -> None:
        await eng.start()
        reqs.extend(eng.add_request(p, LONG) for p in prompts)
        if before_reading is not None:
            before_reading(reqs)
        for req in reqs:  # (one after another: a gather's future, cancelled by the interrupt, went unread)
            await asyncio.wait_for(read(req), HANG_GUARD_S)
    with pytest.raises(interrupt):
        asyncio.run(main())
    monkeypatch.undo()
    return reqs


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_the_engine_loop_ends_its_live_requests(monkeypatch, caplog, interrupt):
    """asyncio.run(main) queues two requests and reads their streams (as the replay does, with add_request); the
    interrupt lands in the loop mid-batch and goes out of asyncio.run. Both requests ended aborted, each with its
    last event, and nothing stays listed; the engine then serves (test_raise_cancel_s70.serves_on), and the ended
    loop task, collected, adds no "Task exception was never retrieved" to the interrupt's own traceback."""
    eng = make_engine(num_pages=256)
    reqs = interrupted_run(monkeypatch, eng, (PROMPT, [4, 5, 6, 7]), interrupt, at_step=5)
    assert [r.state for r in reqs] == [RequestState.ABORTED] * 2, [(r.rid, r.state) for r in reqs]
    assert all(r.queue.qsize() and r.queue._queue[-1].finished for r in reqs)  # (their last event, unread)
    assert_nothing_queued(eng)
    serves_on(eng)
    gc.collect()  # (the interrupted loop task, replaced by serves_on's)
    assert "never retrieved" not in caplog.text, caplog.text


# -- replay_async on a program's own loop ---------------------------------------------------------
@pytest.mark.asyncio
async def test_replay_async_on_a_programs_loop_leaves_its_sigterm_handler():
    """The program set a SIGTERM handler on its loop; a replay awaited there leaves it in place: a SIGTERM after
    the replay still reaches it (it was replaced, then removed, and SIGTERM did nothing at all)."""
    loop, got = asyncio.get_running_loop(), []
    previous = signal.getsignal(signal.SIGTERM)
    loop.add_signal_handler(signal.SIGTERM, got.append, "the program's")
    try:
        items = [replay.ReplayItem(i, i + 1, 0.0, [i + 1] * 8, 2) for i in range(2)]
        config = EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=4).with_hicache(enable=True)
        run = await replay.replay_async(config, items)
        assert run["engine_crash"] is None and all(o.error is None for o in run["outcomes"])
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(HANG_GUARD_S * 100):
            if got:
                break
            await asyncio.sleep(0.01)
        assert got == ["the program's"], "the program's SIGTERM handler is gone: SIGTERM did nothing"
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)


# -- the cost model raising as it admits a write --------------------------------------------------
WRITE_CASES = {  # write policy, L1 pages, the cost model's method that raises
    "selective_backup_at_a_hit": ("write_through_selective", 64, "worth_writing"),
    "write_back_eviction_veto": ("write_back", 16, "worth_writing"),
    "write_back_backup_cost": ("write_back", 16, "backup_worth_its_cost"),
    "backups_after_a_step": ("write_through", 64, "worth_writing"),
}


@pytest.mark.parametrize("case", sorted(WRITE_CASES))
def test_a_cost_model_raising_as_it_admits_a_write_refuses_the_write(monkeypatch, case):
    """Every request gets a no-cache engine's tokens (none failed, the loop did not crash); the failure is counted
    as failures.cost_model; every tier is whole."""
    write_policy, num_pages, method = WRITE_CASES[case]
    eng = make_engine(num_pages=num_pages, policy="cost", write_policy=write_policy)

    def broken(*args, **kwargs):
        raise RuntimeError("cost model bug")
    monkeypatch.setattr(eng.cache.cost, method, broken)
    prompts = [PROMPT, PROMPT, OTHER, [9] * 30, PROMPT, [3] * 40]
    for prompt in prompts:
        [result] = eng.generate([prompt], SamplingParams(max_tokens=4))
        assert result.error is None and result.output_ids == asyncio.run(reference(prompt)), (prompt, result)
    assert eng.metrics()["failures"].get("cost_model", 0) >= 1
    assert_nothing_queued(eng)
    assert_whole(eng.cache)
    asyncio.run(eng.shutdown())

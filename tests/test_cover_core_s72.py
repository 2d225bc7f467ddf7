"""Session 72 coverage hunt, core: the replay-trace driver's rules no test ran (scheduler/replay.py, replay_args.py,
trace.py), each as a user meets it: a trace that cannot be read or holds no usable request is one line and exit 2
(not a traceback); an engine loop that dies under the replay ends the run (exit 1, the requests failed) instead of
waiting forever; a cache that fails its integrity check fails the run; a request that ends for another reason than
"length"/"stop" counts as failed; the summary prints without `rich`; a --json-out that cannot be written after the
run is one line; a --json-out whose directory cannot be made is refused before the run; a script's own flags
(probe_start.py) parse beside the replay's; the trace module's own argument checks; and the timeline tool
(scheduler/timeline.py, timeline_views.py) over a run of malformed op, batch and occupancy events."""
from __future__ import annotations

import asyncio
import io
import sys
from types import SimpleNamespace

import pytest

from scheduler import replay
from scheduler.engine import Engine
from scheduler.presets import model_config_of
from scheduler.replay import (ReplayItem, _one, build_items, format_summary, main, print_summary,
                              replay_async, run_cli)
from scheduler.replay_args import build_parser, config_from_replay_args, fill_defaults
from scheduler.timeline import build_timeline
from scheduler.timeline_views import format_tables, png_ms, print_tables
from scheduler.trace import SynthPrompt, TokenSynth, TraceRecord, load_trace, scale_record
from test_replay_hunt import HOUR_MS
from test_timeline import MS, T0_NS, batch, occ, op, req

SIM = ["--simulate", "--no-progress", "--max-requests", "3"]  # bundled sample, no model: fast
HANG_GUARD_S = 20
BAD = '{"timestamp": 1, "input_length": 700, "output_length": 4}\n'  # no hash_ids


def exits(capsys, argv) -> tuple[int, str, str]:
    """run_cli's exit: (code, stderr, stdout)."""
    with pytest.raises(SystemExit) as exc:
        run_cli(argv)
    out, err = capsys.readouterr()
    return exc.value.code, err, out


# -- bad trace input -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["missing", "a directory"])
def test_a_trace_that_cannot_be_read_is_one_line_and_exit_2(tmp_path, capsys, kind):
    path = tmp_path / "no.jsonl" if kind == "missing" else tmp_path
    code, err, _ = exits(capsys, ["--trace", str(path), "--simulate", "--no-progress"])
    assert code == 2 and "cannot read trace" in err and str(path) in err and "Traceback" not in err


@pytest.mark.parametrize("text", ["", "\n\n", BAD * 3], ids=["empty", "blank lines", "only bad lines"])
def test_a_trace_with_no_usable_request_is_one_line_and_exit_2(tmp_path, capsys, text):
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    code, err, _ = exits(capsys, ["--trace", str(path), "--simulate", "--no-progress"])
    assert code == 2 and f"{path}: no usable request" in err
    assert err.count("skipped: missing field(s): hash_ids") == text.count("\n") * (text == BAD * 3)


def test_a_json_out_whose_directory_cannot_be_made_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    (tmp_path / "f").write_text("a file, not a directory")
    ran = []
    monkeypatch.setattr(replay, "replay", lambda *a, **kw: ran.append(1))
    code, err, _ = exits(capsys, [*SIM, "--json-out", str(tmp_path / "f" / "out.json")])
    assert code == 2 and "--json-out: cannot create the directory of" in err and not ran


def test_a_json_out_that_cannot_be_written_after_the_run_is_one_line(tmp_path, capsys, monkeypatch):
    """(A --json-out that became unwritable during the run: its check before the run is skipped here.) The summary
    is printed first, then one line, exit 2."""
    monkeypatch.setattr(replay, "check_writable", lambda *a: None)
    code, err, out = exits(capsys, [*SIM, "--json-out", str(tmp_path)])  # a directory
    assert code == 2 and f"error: --json-out: cannot write {tmp_path}" in err and "Traceback" not in err
    assert "outputs digest" in out


# -- the run's own failures ------------------------------------------------------------------------
def sample(n: int = 3):
    args = build_parser().parse_args(["--simulate", "--max-requests", str(n)])
    fill_defaults(args)
    config = config_from_replay_args(args)
    records, _ = load_trace(args.trace, max_requests=n)
    return config, build_items(records, model_config_of(config.model).vocab_size, args.block_tokens,
                               max_output_tokens=args.max_output_tokens)


@pytest.mark.asyncio
async def test_an_engine_loop_that_dies_under_the_replay_ends_the_run(monkeypatch):
    """The engine's loop task ends (here as the first request is queued, failing none) while the replay waits on a
    request: the run ends, naming the loop's error, every request failed, the request it waited on aborted (no live
    request left)."""
    async def dies(self):
        await self._wake.wait()  # (the first request queued: add_request wakes the loop)
        raise RuntimeError("injected: the loop died")
    monkeypatch.setattr(Engine, "_loop", dies)
    aborted = []
    real_abort = Engine.abort
    monkeypatch.setattr(Engine, "abort", lambda self, rid, stop=False: aborted.append(rid) or real_abort(self, rid))
    config, items = sample()
    run = await asyncio.wait_for(replay_async(config, items), HANG_GUARD_S)
    assert run["engine_crash"] == "engine loop stopped: RuntimeError('injected: the loop died')"
    assert [o.error for o in run["outcomes"]] == [run["engine_crash"]] * len(items)
    assert aborted == ["r0-line1"]


def test_a_cache_that_fails_its_integrity_check_fails_the_run(monkeypatch, capsys):
    def broken(self):
        raise AssertionError("injected: L1 page 7 is free and in the tree")
    monkeypatch.setattr(Engine, "check_integrity", broken)
    s = run_cli(SIM)
    assert s["completed"] == 3 and s["integrity"] == "AssertionError: injected: L1 page 7 is free and in the tree"
    assert main(SIM) == 1


@pytest.mark.asyncio
async def test_a_request_that_ends_for_another_reason_counts_failed():
    """A request ended "abort" (no error of its own) is a failed request, its reason named."""
    class Req:
        rid, state, served_hit_tokens, recomputed_tokens, preemptions = "r0", SimpleNamespace(done=True), {}, 0, 0
        queue = asyncio.Queue()
    Req.queue.put_nowait(SimpleNamespace(token_id=5, finished=True, finish_reason="abort", error=None))
    engine = SimpleNamespace(add_request=lambda prompt, params, rid: Req)
    out = await _one(engine, ReplayItem(0, 1, 0.0, [1, 2, 3], 4), "r")
    assert out.output_ids == [5] and out.error == "finished with reason 'abort'"


def test_the_summary_prints_without_rich(monkeypatch):
    s = run_cli(SIM)
    monkeypatch.setitem(sys.modules, "rich.console", None)  # (import rich.console raises ImportError)
    buf = io.StringIO()
    print_summary(s, file=buf)
    assert buf.getvalue() == format_summary(s) + "\n"


# -- arguments and the trace module ------------------------------------------------------------------
def test_a_scripts_own_flags_parse_beside_the_replays():
    parser = build_parser("probe", lambda p: p.add_argument("--top", type=int, default=25, help="functions to list"))
    args = parser.parse_args(["--top", "7", "--simulate"])
    assert args.top == 7 and args.simulate
    text = parser.format_help()
    assert text.index("--top") < text.index("--trace")


def test_the_trace_modules_own_argument_checks():
    rec = TraceRecord(3, 0.0, 700, 4, (1, 2))
    with pytest.raises(ValueError, match="block_tokens must be positive, got 0"):
        scale_record(rec, 0)
    for bad in [(0, 16, 0), (10, 0, 0), (10, 16, -1)]:
        with pytest.raises(ValueError, match="vocab_size and block_tokens must be positive, seed non-negative"):
            TokenSynth(*bad)
    synth = TokenSynth(100, 16)
    scaled = scale_record(rec, 16)
    assert SynthPrompt(synth, scaled, 0).tokens() == [] and len(SynthPrompt(synth, scaled, 0)) == 0
    assert SynthPrompt(synth, scaled, 17).tokens() == synth.prompt_tokens(scaled)[:17]



# -- the timeline tool over a log with malformed events --------------------------------------------------
def test_malformed_op_batch_and_occupancy_events_are_skipped_and_counted_and_their_run_draws_nothing():
    """A run whose known events all lack a usable field (an op's state not a string, its id not an integer; a batch
    ending before it starts, its kind not a string; an occupancy's pages not integers, its tier missing) adds
    nothing and counts each; the PNG draws the run after it where the run before it ended, and the tables print
    as plain text where the output is no terminal."""
    run_start = lambda t_ms: {"event": "run_start", "ts_ns": T0_NS + int(t_ms * MS), "pid": 1}  # noqa: E731
    bad = [op(1, 1, "backup", "L1_PRIVATE", None), op(2, "one", "backup", "L1_PRIVATE", "D2H_PENDING"),
           batch(3, 1, "prefill", start_ms=4), {**batch(5, 2, "decode", start_ms=4), "kind": 7},
           occ(6, "l1", "many", 10), {**occ(7, "l2", 1, 10), "tier": None}]
    first = [req(0, "r0", "queued"), req(5, "r0", "finished", output_tokens=1)]
    third = [req(HOUR_MS, "r1", "queued"), req(HOUR_MS + 2, "r1", "finished", output_tokens=1)]
    tl = build_timeline([run_start(0), *first, run_start(10), *bad, run_start(HOUR_MS), *third])
    assert tl.num_runs == 3 and tl.num_malformed_events == len(bad) and tl.num_unknown_events == 0
    assert not tl.ops and not tl.batches and not tl.occupancy
    assert tl.run_first_ns[1] is None and tl.run_last_ns[1] is None
    ms = png_ms(tl)
    a, b = tl.requests.values()
    assert [ms(a.arrival_ns, a.run), ms(a.end_ns, a.run), ms(b.arrival_ns, b.run), ms(b.end_ns, b.run)] == \
        [0.0, 5.0, 5.0, 7.0]
    buf = io.StringIO()
    print_tables(tl, file=buf)
    assert buf.getvalue() == format_tables(tl) and "r1" in buf.getvalue()

"""Guards found untested by session 67's mutation check of the replay driver (scheduler/replay.py, replay_args.py,
replay_memory.py), the trace reader (scheduler/trace.py) and the timeline (scheduler/timeline.py, timeline_views.py).

The replay's pacing and concurrency, checked on a fake engine and a fake clock (`_dispatch` and `_one` read
time.perf_counter and sleep through the module's names): arrivals at their trace time times --time-scale, at most
--concurrency requests in flight, TTFT at the first token. Then what the command derives: arrivals from the earliest
record, --max-output-tokens clipping only longer outputs, the will-fail line at exactly the model's positions, the
--compare-no-cache baseline with every cache off and the exit status of a mismatch; and what the timeline shows of a
log whose later run's clock restarted and of a request still running."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import pytest

from scheduler import replay, replay_memory
from scheduler.replay import ReplayItem, build_items
from scheduler.request import TokenEvent
from scheduler.timeline import build_timeline
from scheduler.timeline_views import op_rows
from scheduler.trace import TraceRecord
from test_timeline import MS, T0_NS, op, req


# -- the replay's driver on a fake engine ----------------------------------------------------------
class FakeEngine:
    """What `_one` and `_dispatch` use of an Engine: each request yields its tokens `token_s` fake seconds
    apart (a few loop turns each), then finishes with "length"; counts the requests in flight at once."""

    def __init__(self, clock: NS, token_s: float = 1.0):
        self.clock, self.token_s = clock, token_s
        self.in_flight = self.max_in_flight = self.drains = 0
        self.rids: list[str] = []
        self.cache = NS(drain=self._drain)

    async def _drain(self) -> None:
        self.drains += 1

    def add_request(self, prompt, params, rid):
        req = NS(rid=rid, queue=asyncio.Queue(), state=NS(done=False), served_hit_tokens={"l1": 0, "l2": 0, "l3": 0},
                 recomputed_tokens=len(prompt), preemptions=0)
        self.rids.append(rid)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        asyncio.get_running_loop().create_task(self._serve(req, params.max_tokens))
        return req

    async def _serve(self, req, max_tokens: int) -> None:
        for i in range(max_tokens):
            for _ in range(3):
                await asyncio.sleep(0)
            self.clock.now += self.token_s
            req.queue.put_nowait(TokenEvent(req.rid, 7, i))
        self.in_flight -= 1
        req.state.done = True
        req.queue.put_nowait(TokenEvent(req.rid, None, max_tokens, finished=True, finish_reason="length"))


@pytest.fixture
def fake_clock(monkeypatch) -> NS:
    """The replay module's clock and sleep, faked: a sleep advances the clock at once; `sleeps` lists each."""
    clock = NS(now=0.0, sleeps=[])

    async def sleep(delay: float) -> None:
        clock.sleeps.append(delay)
        clock.now += delay
        await asyncio.sleep(0)

    monkeypatch.setattr(replay, "time", NS(perf_counter=lambda: clock.now))
    monkeypatch.setattr(replay, "asyncio", NS(Semaphore=asyncio.Semaphore, sleep=sleep, gather=asyncio.gather,
                                              get_running_loop=asyncio.get_running_loop))
    return clock


def items_at(*arrivals_s: float, output_tokens: int = 2) -> list[ReplayItem]:
    return [ReplayItem(i, i + 1, a, [1, 2, 3], output_tokens) for i, a in enumerate(arrivals_s)]


async def dispatch(engine, items, time_scale: float, concurrency: int) -> list:
    outcomes = [None] * len(items)
    await replay._dispatch(engine, items, time_scale, concurrency, "r", outcomes, lambda o: None)
    return outcomes


@pytest.mark.asyncio
async def test_requests_are_submitted_at_their_arrival_times_the_time_scale(fake_clock):
    """--time-scale 0.5: a request 2 s into the trace is sent 1 s into the replay, one at 3 s at 1.5 s."""
    outcomes = await dispatch(FakeEngine(fake_clock, token_s=0.0), items_at(0.0, 2.0, 3.0), 0.5, 8)
    assert fake_clock.sleeps == pytest.approx([1.0, 0.5])
    assert [o.error for o in outcomes] == [None] * 3


@pytest.mark.asyncio
async def test_no_more_requests_are_in_flight_than_the_concurrency(fake_clock):
    engine = FakeEngine(fake_clock)
    outcomes = await dispatch(engine, items_at(*[0.0] * 8), 0.0, 3)
    assert engine.max_in_flight == 3 and fake_clock.sleeps == []
    assert all(o.error is None and len(o.output_ids) == 2 for o in outcomes)


@pytest.mark.asyncio
async def test_with_concurrency_1_each_request_and_its_cache_work_end_before_the_next(fake_clock):
    """--concurrency 1 is the deterministic mode: one request in flight, the cache drained after each."""
    engine = FakeEngine(fake_clock)
    await dispatch(engine, items_at(0.0, 0.0, 0.0), 0.0, 1)
    assert engine.max_in_flight == 1 and engine.drains == 3 + 1


@pytest.mark.asyncio
async def test_ttft_is_the_time_to_the_first_token_and_latency_to_the_last(fake_clock):
    """Tokens 1 fake second apart: TTFT 1 s, latency 3 s for 3 tokens (not the last token's time as TTFT)."""
    [out] = await dispatch(FakeEngine(fake_clock), items_at(0.0, output_tokens=3), 0.0, 1)
    assert (out.ttft_s, out.latency_s, out.finish_reason) == (1.0, 3.0, "length")
    assert out.recomputed_tokens == 3 and out.hit_tokens == {"l1": 0, "l2": 0, "l3": 0}


def test_the_replay_warns_of_no_failure_for_a_request_exactly_at_the_models_positions(capsys):
    """The engine refuses prompt + max_tokens - 1 > positions (Engine.validate): a request needing exactly the
    model's positions is served, so the line before the replay does not count it; one token more is counted."""
    from scheduler.config import EngineConfig
    from scheduler.replay_args import build_parser

    parser = build_parser()
    args = parser.parse_args(["--max-total-tokens", "4096", "--block-tokens", "16"])
    config = EngineConfig(model="tiny", device="cpu", max_total_tokens=4096)
    replay_memory.warn_will_fail(parser, args, [NS(prompt_tokens=100, output_tokens=29)], config, 128)
    assert "will fail" not in capsys.readouterr().err
    replay_memory.warn_will_fail(parser, args, [NS(prompt_tokens=100, output_tokens=30)], config, 128)
    assert "1 of 1 requests need more than the model's 128 positions" in capsys.readouterr().err


def test_the_no_cache_baseline_runs_with_every_cache_off(monkeypatch, capsys):
    """--compare-no-cache replays the trace again with the prefix cache (L1) and L2/L3 off: outputs to compare
    with, not a second cached run (the engine's replays faked: only the configurations they get are checked)."""
    from scheduler.replay import DIRECTIONS, Outcome

    configs = []

    def fake_replay(config, items, **kw):
        configs.append(config)
        return {"outcomes": [Outcome(it, [5], finish_reason="length") for it in items], "integrity": "passed",
                "metrics": {"directions": {d: {"bytes": 0} for d in DIRECTIONS}}, "wall_s": 1.0,
                "engine_crash": None}

    monkeypatch.setattr(replay, "replay", fake_replay)
    summary = replay.run_cli(["--compare-no-cache", "--max-requests", "3", "--no-progress"])
    cached, base = configs
    assert (cached.enable_prefix_cache, cached.hicache.enable) == (True, True)
    assert (base.enable_prefix_cache, base.hicache.enable, base.log_json) == (False, False, None)
    assert summary["compare_no_cache"]["match"] and summary["completed"] == 3


# -- exit status -----------------------------------------------------------------------------------
@pytest.mark.parametrize("edit, status", [({}, 0), ({"compare_no_cache": {"match": False}}, 1),
                                          ({"compare_no_cache": {"match": True}}, 0),
                                          ({"integrity": "AssertionError: leak"}, 1),
                                          ({"engine_crash": "engine loop stopped"}, 1)])
def test_the_exit_status_fails_a_run_whose_outputs_differ_without_the_cache(monkeypatch, edit, status):
    """main(): 1 when --compare-no-cache found other outputs, the integrity check failed or the engine crashed."""
    summary = {"completed": 3, "engine_crash": None, "integrity": "passed", **edit}
    monkeypatch.setattr(replay, "run_cli", lambda argv=None: summary)
    assert replay.main([]) == status


# -- trace -> items --------------------------------------------------------------------------------
def test_arrivals_are_relative_to_the_earliest_record_not_the_first_line():
    """A trace whose lines are out of time order: requests run by arrival, arrivals from the earliest timestamp."""
    recs = [TraceRecord(1, 131_999.0 + 20, 512, 4, (1,)), TraceRecord(2, 131_999.0, 512, 4, (2,))]
    items = build_items(recs, vocab_size=1000, block_tokens=16)
    assert [(it.line_no, it.arrival_s) for it in items] == [(2, 0.0), (1, pytest.approx(0.02))]


def test_max_output_tokens_clips_long_outputs_and_keeps_short_ones():
    recs = [TraceRecord(1, 0.0, 512, 4, (1,)), TraceRecord(2, 1.0, 512, 400, (2,)), TraceRecord(3, 2.0, 512, 0, (3,))]
    items = build_items(recs, vocab_size=1000, block_tokens=512, max_output_tokens=32)
    assert [it.output_tokens for it in items] == [4, 32, 1]  # (no output: one token, the prefill's)


# -- timeline --------------------------------------------------------------------------------------
def test_ops_are_listed_run_by_run_even_when_a_later_runs_clock_restarted():
    """A run after a reboot has smaller monotonic times than the run before it: its ops still come after that
    run's, as its requests do (the Operations table and the Chrome trace follow tl.ops)."""
    run_start = lambda t_ms: {"event": "run_start", "ts_ns": T0_NS + int(t_ms * MS), "pid": 1}  # noqa: E731
    first = [op(100, 1, "backup", "L1_PRIVATE", "D2H_PENDING"), op(101, 1, "backup", "D2H_PENDING", "L1_L2"),
             op(102, 1, "backup", "L1_L2", "L1_L2_ONLY")]
    rebooted = [op(1, 1, "backup", "L1_PRIVATE", "D2H_PENDING"), op(2, 1, "backup", "D2H_PENDING", "L1_L2"),
                op(3, 1, "backup", "L1_L2", "L1_L2_ONLY")]
    tl = build_timeline([run_start(99), *first, run_start(0), *rebooted])
    assert [(o.key, o.run) for o in tl.ops.values()] == [(1, 0), ("1#2", 1)]
    assert [row[0] for row in op_rows(tl)] == ["1", "1#2"]


def test_a_running_requests_last_phase_never_ends_before_it_starts():
    """phase_spans(open_end_ns) of a request that never ended: its last phase runs to open_end_ns, or to its own
    last state if that is later (the tests' own shortcut, phase_spans(0), included)."""
    tl = build_timeline([req(0, "a", "queued"), req(5, "a", "prefill_start")])
    spans = tl.requests["a"].phase_spans(0)
    assert [(p, a - T0_NS, b - T0_NS) for p, a, b in spans] == [("queued", 0, 5 * MS), ("prefill", 5 * MS, 5 * MS)]

"""Edges of the user-facing tools found by a bug hunt (session 26), each a regression test: non-finite
cache sizes, ratios and cost margins refused; a negative --synth-seed a usage error; trace and log
lines with valid JSON Python cannot use (huge integers, an "event" that is not a string) skipped and
counted, not a traceback; different hash ids never one token block; the timeline showing what the
request that ran restored (after a discarded overlapped restore) and the tiers' final occupancy."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import structlog

from hicache.config import HiCacheConfig
from hicache.faults import Fault, FaultInjector
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.presets import model_config_of
from scheduler.replay import build_items, main
from scheduler.request import SamplingParams
from scheduler.timeline import build_timeline, read_events
from scheduler.trace import TokenSynth, TraceProblem, TraceRecord, load_trace, parse_line
from test_faults import PAGE, PROMPT, REUSABLE, reference, run_one
from test_restore_overlap import _prefix_only_in_l2

SIM = ["--simulate", "--no-progress", "--max-requests", "2"]  # bundled sample, no model: fast
GOOD = '{"timestamp": 0, "input_length": 700, "output_length": 40, "hash_ids": [1, 2]}'
VOCAB = model_config_of("tiny").vocab_size
SAMPLE = Path(__file__).resolve().parent.parent / "scheduler" / "sample_trace.jsonl"


@pytest.fixture
def restore_logging():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)

@pytest.mark.parametrize("flag", ["--hicache-size-gb", "--hicache-storage-size-gb", "--hicache-ratio",
                                  "--hicache-storage-ratio"])
def test_replay_refuses_an_infinite_cache_size_with_exit_2(capsys, flag):
    with pytest.raises(SystemExit) as exc:  # before: OverflowError: cannot convert float infinity to integer
        main([*SIM, flag, "inf"])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [
    ("host_size_gb", math.inf), ("storage_size_gb", math.inf), ("host_ratio", math.inf),
    ("storage_ratio", math.inf), ("host_ratio", math.nan), ("storage_ratio", math.nan),
    ("cost_margin", math.nan),
])
def test_hicache_config_refuses_non_finite_values(field, value):
    with pytest.raises(ValueError):
        HiCacheConfig(**{field: value})


def test_negative_synth_seed_is_a_usage_error(capsys):
    # before: ValueError("vocab_size and block_tokens must be positive, seed non-negative") traceback
    # from TokenSynth, raised after the trace was read (REPLAY_MINIMUMS has no synth_seed)
    with pytest.raises(SystemExit) as exc:
        main([*SIM, "--synth-seed", "-1"])
    assert exc.value.code == 2
    assert "--synth-seed" in capsys.readouterr().err


@pytest.mark.parametrize("digits", [400, 5000])
def test_a_huge_integer_timestamp_is_a_problem_not_a_crash(tmp_path: Path, digits):
    # valid JSON; 401 digits: math.isfinite() raises OverflowError; 5001 digits: json.loads raises a
    # ValueError that is not a JSONDecodeError (Python's 4300-digit int conversion limit)
    line = '{"timestamp": 1' + "0" * digits + ', "input_length": 700, "output_length": 40, "hash_ids": [1, 2]}'
    assert isinstance(parse_line(line, 2), TraceProblem)
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n" + line + "\n")
    records, problems = load_trace(path)  # "Never stops half way on a bad line"
    assert len(records) == 1 and [p.line_no for p in problems] == [2]


def test_replay_of_a_trace_with_a_huge_integer_does_not_crash(tmp_path: Path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n" + '{"timestamp": 1' + "0" * 400 +
                    ', "input_length": 700, "output_length": 40, "hash_ids": [1, 2]}\n')
    with pytest.raises(SystemExit) as exc:
        main(["--trace", str(path), "--strict", "--simulate", "--no-progress"])
    assert exc.value.code == 2 and "line 2" in capsys.readouterr().err


def load_timeline_script():
    spec = importlib.util.spec_from_file_location("timeline_script", str(Path(__file__).resolve().parent.parent / "scripts" / "timeline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_event_field_of_another_type_is_skipped_not_a_crash():
    events = [{"event": "request", "rid": "a", "state": "queued", "ts_ns": 1},
              {"event": ["request"], "ts_ns": 2}, {"event": {"x": 1}, "ts_ns": 3},
              {"event": "request", "rid": "a", "state": "finished", "ts_ns": 5}]
    tl = build_timeline(events)
    assert list(tl.requests) == ["a"] and tl.requests["a"].final_state == "finished"
    assert tl.num_unknown_events + tl.num_malformed_events == 2


def test_timeline_script_on_such_a_log(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    log.write_text('{"event": "request", "rid": "a", "state": "queued", "ts_ns": 1}\n'
                   '{"event": ["request"], "ts_ns": 2}\n')
    assert load_timeline_script().main([str(log), "--no-tables"]) == 0


def test_a_line_with_a_huge_integer_is_a_bad_line_not_a_crash(tmp_path):
    # valid JSON, but json.loads raises ValueError (not JSONDecodeError) past 4300 digits
    log = tmp_path / "run.jsonl"
    log.write_text('{"event": "request", "rid": "a", "state": "queued", "ts_ns": 1}\n'
                   '{"event": "request", "rid": "a", "state": "queued", "ts_ns": 1' + "0" * 5000 + '}\n')
    bad: list[int] = []
    assert len(read_events(log, bad_lines=bad)) == 1 and bad == [2]


def test_different_hash_ids_that_fit_the_digit_field_give_different_blocks():
    """Regression: an id's digits took as many tokens as the id needed and random tokens followed,
    which could spell a longer id's digits: ids 5 and 5 + 512 * k shared a 2-token block for one k
    (358 pairs of the Mooncake trace's ids at 2 tokens a block, 2 at 3)."""
    synth = TokenSynth(VOCAB, 2, seed=0)
    blocks = {tuple(synth.block(5 + VOCAB * k).tolist()) for k in range(VOCAB)}
    assert len(blocks) == VOCAB
    records, _ = load_trace(SAMPLE)
    ids = sorted({h for r in records for h in r.hash_ids})
    for block_tokens in (2, 3):
        synth = TokenSynth(VOCAB, block_tokens, seed=0)
        assert len({tuple(synth.block(h).tolist()) for h in ids}) == len(ids)
    other = 5 + VOCAB * 7
    recs = [TraceRecord(1, 0.0, 512, 10, (5,)), TraceRecord(2, 1.0, 512, 10, (other,))]
    a, b = build_items(recs, VOCAB, 2)
    assert a.prompt != b.prompt


@pytest.mark.asyncio
async def test_timeline_occupancy_matches_the_tiers_at_the_end(tmp_path, restore_logging):
    log = tmp_path / "run.jsonl"
    config = EngineConfig(model="tiny", device="cpu", num_pages=64, page_size=4, log_json=str(log)).with_hicache(
        enable=True, transfer_backend="torch", policy="always")
    eng = Engine(config)
    await eng.start()
    prompt = list(range(1, 42))
    await eng.generate_async([prompt], SamplingParams(max_tokens=1))
    await eng.cache.drain()
    used = {tier.label: alloc.num_pages - alloc.num_free for tier, alloc in eng.cache.tree.allocators.items()}
    await eng.shutdown()
    assert used["l2"] > 0 and used["l3"] > 0  # the prompt was backed up to both tiers

    tl = build_timeline(read_events(log))
    last = {tier: samples[-1].used_pages for tier, samples in tl.occupancy.items()}
    assert last.get("l2", 0) == used["l2"], (last, used)
    assert last.get("l3", 0) == used["l3"], (last, used)


@pytest.mark.asyncio
async def test_timeline_after_a_discarded_overlapped_restore(tmp_path, restore_logging):
    log = tmp_path / "run.jsonl"
    faults = FaultInjector()
    config = EngineConfig(model="tiny", device="cpu", num_pages=48, page_size=PAGE, log_json=str(log)).with_hicache(
        enable=True, transfer_backend="torch", policy="always")
    eng = Engine(config, faults=faults)
    await eng.start()
    await _prefix_only_in_l2(eng)
    faults.arm(Fault.TRANSFER_RAISE)
    result = await run_one(eng)
    assert result.output_ids == await reference(PROMPT)
    assert result.cached_tokens["l2"] == 0  # the engine: recomputed, no L2 hit
    metrics_l2 = eng.metrics()["hit_tokens"]["l2"]
    await eng.cache.drain()
    await eng.shutdown()

    events = read_events(log)
    assert any(e.get("state") == "restore_overlap_discarded" for e in events)  # the scenario happened
    rid = result.rid
    starts = [e for e in events if e.get("rid") == rid and e.get("state") == "prefill_start"]
    assert len(starts) == 2 and starts[0]["hit_l2"] == REUSABLE and starts[-1]["hit_l2"] == 0
    assert starts[-1]["restore_tier"] == "none"

    tl = build_timeline(events)
    span = tl.requests[rid]
    # what the raw log (and the engine's metrics) say about the request that actually ran
    assert span.hit_tokens.get("l2", 0) == starts[-1]["hit_l2"] == 0, span.hit_tokens
    assert span.restore_tier == "none", span.restore_tier
    assert sum(r.hit_tokens.get("l2", 0) for r in tl.requests.values()) == metrics_l2
    # a line the engine itself writes is not a malformed event
    assert tl.num_malformed_events == 0

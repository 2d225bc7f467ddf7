"""Bad input to the user-facing tools: out-of-range EngineConfig fields and replay options are refused
with one line naming them (exit code 2), a replay in which no request completed exits non-zero, and
missing or unwritable paths of scripts/replay_trace.py and scripts/timeline.py are clear errors."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from hicache.config import HiCacheConfig
from scheduler.config import EngineConfig
from scheduler.replay import main, run_cli

REPO = Path(__file__).resolve().parents[1]
SIM = ["--simulate", "--no-progress", "--max-requests", "2"]  # the bundled sample, no model: fast


@pytest.fixture
def restore_logging():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def load_timeline_script():
    spec = importlib.util.spec_from_file_location("timeline_script", REPO / "scripts" / "timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exit_code(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


# -- EngineConfig ---------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("max_prefill_tokens", 0), ("max_prefill_tokens", -1), ("max_running_requests", 0), ("num_pages", -5),
    ("page_size", -4), ("max_total_tokens", -1), ("max_context_tokens", 0), ("max_prompt_tokens", -1),
    ("max_new_tokens_limit", 0), ("cpu_threads", -1), ("gpu_memory_fraction", 0.0), ("gpu_memory_fraction", 1.01),
    ("gpu_memory_fraction", float("nan")),
])
def test_engine_config_refuses_out_of_range_fields(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("host_size_gb", -1.0), ("storage_size_gb", -1.0), ("storage_size_gb", float("nan")), ("io_timeout_s", 0.0),
])
def test_engine_config_refuses_out_of_range_cache_sizes(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(hicache=HiCacheConfig(**{field: value}))


def test_engine_config_accepts_the_lowest_valid_values():
    EngineConfig(num_pages=0, page_size=0, max_prefill_tokens=1, max_running_requests=1, max_prompt_tokens=0,
                 cpu_threads=0, hicache=HiCacheConfig(host_size_gb=0.0, storage_size_gb=0.0))


def test_zero_prefill_budget_is_refused_not_a_hang():
    # before: admission admitted nothing and the replay never ended (the timeout turns that into a failure)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "replay_trace.py"), *SIM,
                           "--max-prefill-tokens", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--max-prefill-tokens" in proc.stderr and "Traceback" not in proc.stderr


# -- replay options -------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [
    ("--max-running-requests", "0"), ("--num-pages", "-5"), ("--l1-tokens", "0"), ("--l1-tokens", "-64"),
    ("--l1-gib", "-1"), ("--l2-gib", "0"), ("--l3-gib", "-1"), ("--l3-tokens", "-64"),
    ("--hicache-storage-size-gb", "-1"), ("--max-input-tokens", "0"), ("--max-output-tokens", "0"),
    ("--max-output-tokens", "-3"), ("--max-requests", "-1"), ("--block-tokens", "0"), ("--time-scale", "-1"),
    ("--time-scale", "inf"), ("--l1-gib", "inf"), ("--l2-gib", "inf"), ("--l3-gib", "inf"),  # hung / crashed
])
def test_replay_refuses_out_of_range_options(capsys, flag, value):
    code, err = exit_code(capsys, [*SIM, flag, value])
    assert code == 2 and flag in err


def test_replay_refuses_an_l1_of_less_than_a_page(capsys):
    code, err = exit_code(capsys, [*SIM, "--l1-gib", "1e-9"])
    assert code == 2 and "--l1-gib" in err and "no page" in err


def test_replay_in_which_no_request_completed_exits_non_zero(capsys):
    assert main([*SIM, "--num-pages", "1"]) == 1  # every prompt is longer than one page
    assert "no request completed" in capsys.readouterr().err


def test_replay_log_json_into_a_missing_directory(tmp_path, restore_logging):
    log = tmp_path / "new" / "dir" / "run.jsonl"
    s = run_cli([*SIM, "--log-json", str(log)])
    assert s["completed"] == 2
    assert json.loads(log.read_text().splitlines()[0])["event"] == "run_start"


def test_replay_json_out_that_cannot_be_written_is_refused_before_the_run(capsys, tmp_path):
    code, err = exit_code(capsys, [*SIM, "--json-out", str(tmp_path)])  # a directory
    assert code == 2 and "--json-out" in err and "trace replay" not in capsys.readouterr().out


def test_replay_transfer_backend_that_fails_is_one_line(capsys, monkeypatch):
    from kernels import chooser

    def no_triton(l1):
        raise RuntimeError("triton unavailable: no CUDA and TRITON_INTERPRET=1 not set before import")

    monkeypatch.setattr(chooser, "verify_triton", no_triton)  # what a CPU machine without the interpreter does
    code, err = exit_code(capsys, ["--no-progress", "--max-requests", "1", "--hicache-transfer-backend", "triton"])
    assert code == 2 and "cannot start the engine" in err and "requested backend 'triton'" in err


# -- timeline -------------------------------------------------------------------------------------
def test_timeline_missing_log_is_a_usage_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        load_timeline_script().main([str(tmp_path / "missing.jsonl")])
    assert exc.value.code == 2 and "cannot read" in capsys.readouterr().err


def test_timeline_outputs_into_missing_directories(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text('{"event": "request", "rid": "a", "state": "queued", "ts_ns": 1}\n'
                   '{"event": "request", "rid": "a", "state": "finished", "ts_ns": 5000}\n')
    chrome, png = tmp_path / "a" / "trace.json", tmp_path / "b" / "c" / "timeline.png"
    assert load_timeline_script().main([str(log), "--no-tables", "--chrome", str(chrome), "--png", str(png)]) == 0
    assert json.loads(chrome.read_text())["traceEvents"] and png.stat().st_size > 0


def test_timeline_output_that_cannot_be_written_is_a_usage_error(capsys, tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text('{"event": "request", "rid": "a", "state": "queued", "ts_ns": 1}\n')
    with pytest.raises(SystemExit) as exc:
        load_timeline_script().main([str(log), "--no-tables", "--chrome", str(tmp_path)])  # a directory
    assert exc.value.code == 2 and "cannot write" in capsys.readouterr().err

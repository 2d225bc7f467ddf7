"""Flag combinations found by a configuration bug hunt: each is refused at startup with one line naming
the flag(s) and the reason (exit code 2), never a traceback, a crash or a silently different setup."""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.config import HiCacheConfig
from scheduler import serve
from scheduler.config import EngineConfig, add_engine_args, config_from_args
from scheduler.replay import main as replay_main

REPO = Path(__file__).resolve().parents[1]
SIM = ["--simulate", "--no-progress", "--max-requests", "2"]  # the bundled sample, no model: fast


def serve_error(capsys, argv: list[str]) -> tuple[int, str]:
    """hicache-serve's exit code and stderr for a configuration it must refuse before serving."""
    code = serve.main(["--port", "0", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def serve_subprocess(argv: list[str]) -> subprocess.CompletedProcess:
    """hicache-serve in a subprocess (what it did before: serve, here until the timeout)."""
    return subprocess.run([sys.executable, "-m", "scheduler.server", "--device", "cpu", *argv],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"})


def engine_config(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(argv))


# -- log and pool paths / sizes at the server's startup ------------------------------------------
def test_server_log_json_that_cannot_be_created_is_one_line(capsys, tmp_path):
    # before: NotADirectoryError traceback out of configure_logging
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = serve_error(capsys, ["--log-json", str(blocker / "sub" / "run.jsonl")])
    assert code == 2 and "--log-json" in err


@pytest.mark.parametrize("argv, flag", [
    (["--num-pages", "100000000000000"], "--num-pages"),  # before: RuntimeError traceback (alloc_cpu)
    (["--max-total-tokens", "100000000000000000"], "--max-total-tokens"),  # RuntimeError: size overflowed
    (["--enable-hicache", "--hicache-size-gb", "1e30"], "--hicache-size-gb"),  # TypeError: overflow (zeros)
    (["--enable-hicache", "--hicache-storage-size-gb", "1e30"], "--hicache-storage-size-gb"),
])
def test_server_pool_sizes_that_overflow_are_one_line(capsys, argv, flag):
    code, err = serve_error(capsys, argv)
    assert code == 2 and flag in err


@pytest.mark.skipif(not Path("/proc/sys/vm/overcommit_memory").exists()
                    or Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "0",
                    reason="needs the kernel to refuse an allocation larger than the machine at once")
def test_server_l1_pool_larger_than_the_machine_is_one_line(capsys):
    # 2e9 pages of 2 KiB (tiny, 4-token pages, float32): 4 TB; before: RuntimeError traceback
    code, err = serve_error(capsys, ["--num-pages", "2000000000"])
    assert code == 2 and "cannot start the engine" in err


@pytest.mark.parametrize("size", ["1e30", "1e300"])
@pytest.mark.parametrize("flag", ["--hicache-size-gb", "--hicache-storage-size-gb"])
def test_replay_cache_size_that_overflows_names_its_flag(capsys, flag, size):
    # before: exit 2 with "Maximum allowed dimension exceeded" (simulated), naming nothing; at 1e300
    # (its bytes past float's range) an OverflowError traceback
    with pytest.raises(SystemExit) as exc:
        replay_main([*SIM, flag, size])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_tier_sizes_past_floats_range_are_refused_naming_their_flag():
    with pytest.raises(ValueError, match="--hicache-size-gb"):  # (OverflowError: float infinity)
        HiCacheConfig(host_size_gb=1e300).host_pages(64, 2048)
    with pytest.raises(ValueError, match="--hicache-ratio"):
        HiCacheConfig(host_ratio=1e308).host_pages(64, 2048)
    with pytest.raises(ValueError, match="--hicache-storage-size-gb"):
        HiCacheConfig(storage_size_gb=1e300).storage_pages(64, 2048)
    with pytest.raises(ValueError, match="--hicache-storage-ratio"):
        HiCacheConfig(storage_ratio=1e308).storage_pages(1 << 20, 2048)


def test_replay_num_pages_that_overflows_is_one_line(capsys):
    # before: numpy MemoryError traceback (simulated: the allocator's owner table)
    with pytest.raises(SystemExit) as exc:
        replay_main([*SIM, "--num-pages", "100000000000000"])
    assert exc.value.code == 2 and "--num-pages" in capsys.readouterr().err


def test_tier_page_counts_beyond_int32_page_ids_are_refused():
    with pytest.raises(ValueError, match="--hicache-size-gb"):
        HiCacheConfig(host_size_gb=1e30).host_pages(64, 2048)
    with pytest.raises(ValueError, match="--hicache-storage-ratio"):
        HiCacheConfig(storage_ratio=1e12).storage_pages(1 << 20, 2048)
    assert HiCacheConfig(host_size_gb=1.0).host_pages(64, 2048) == (1 << 30) // 2048  # ordinary sizes


# -- L3 that would hold no page ------------------------------------------------------------------
@pytest.mark.parametrize("field, value, flag", [
    ("storage_ratio", 1e-6, "--hicache-storage-ratio"), ("storage_size_gb", 1e-12, "--hicache-storage-size-gb"),
])
def test_positive_l3_capacity_that_holds_no_page_is_refused(field, value, flag):
    # before: 0 pages, and L3 was silently off although a capacity was asked for
    with pytest.raises(ValueError, match=flag):
        HiCacheConfig(**{field: value}).storage_pages(1536, 2048)
    assert HiCacheConfig(storage_ratio=0.0).storage_pages(1536, 2048) == 0  # 0: no L3, as documented
    assert HiCacheConfig(storage_size_gb=0.0).storage_pages(1536, 2048) == 0


def test_replay_l3_ratio_that_holds_no_page_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:  # before: the replay ran with no L3
        replay_main([*SIM, "--hicache-storage-ratio", "1e-6"])
    assert exc.value.code == 2 and "--hicache-storage-ratio" in capsys.readouterr().err


# -- threads, seed ---------------------------------------------------------------------------------
def test_cpu_threads_beyond_the_machines_cpus_is_refused():
    with pytest.raises(ValueError, match="--cpu-threads"):
        EngineConfig(cpu_threads=(os.cpu_count() or 1) + 1)
    EngineConfig(cpu_threads=os.cpu_count() or 1)


def test_replay_with_absurd_cpu_threads_is_a_usage_error_not_a_segfault():
    # before: torch.set_num_threads(100000) and a SIGSEGV (exit -11)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "replay_trace.py"), *SIM, "--cpu-threads", "100000"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--cpu-threads" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("seed", [-1, 2 ** 64, 99999999999999999999999])
def test_seed_out_of_range_names_the_flag(seed):
    # before: accepted (a simulation) or "Overflow when unpacking long long" naming nothing
    with pytest.raises(ValueError, match="--seed"):
        EngineConfig(seed=seed)
    EngineConfig(seed=2 ** 64 - 1)


def test_server_seed_out_of_range_names_the_flag(capsys):
    code, err = serve_error(capsys, ["--seed", "99999999999999999999999"])
    assert code == 2 and "--seed" in err


# -- cost-model priors ------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--hicache-recompute-us-per-token", "--hicache-host-bandwidth-gib-s",
                                  "--hicache-storage-bandwidth-gib-s"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_cost_priors_out_of_range_name_their_flag(flag, value):
    # before: some started (an infinite bandwidth), the others' errors named a field, not the flag
    with pytest.raises(ValueError, match=flag):
        engine_config([flag, value])


# -- the redis backend's URL ---------------------------------------------------------------------
@pytest.mark.parametrize("url", ["foo", "http://localhost:6379/0", "redis://localhost:notaport/0",
                                 "redis://localhost:99999/0", "redis://localhost:6379/x", "redis://localhost:6379/-1",
                                 "redis://127.0.0.1:6390?db=x", "redis://:pw@h/0?socket_timeout=abc",
                                 "unix:///tmp/redis.sock?db=y"])
def test_malformed_redis_url_names_the_flag(url):
    # before: the redis client's message without the flag, or (a db of "x") silently db 0; a query's options
    # (session 51) passed, then the client's "Invalid value for 'db' in connection URL." stopped the start
    with pytest.raises(ValueError, match="--hicache-storage-url"):
        engine_config(["--enable-hicache", "--hicache-storage-backend", "redis", "--hicache-storage-url", url])


@pytest.mark.parametrize("url", ["redis://localhost:6379/0", "redis://:secret@localhost:6379", "rediss://h:1/3",
                                 "unix:///tmp/redis.sock", "redis://localhost", "redis://h?db=2",
                                 "unix:///tmp/redis.sock?db=2", "redis://h/1?socket_timeout=2.5"])
def test_well_formed_redis_urls_are_accepted(url):
    engine_config(["--enable-hicache", "--hicache-storage-backend", "redis", "--hicache-storage-url", url])


def test_server_malformed_redis_url_names_the_flag(capsys):
    code, err = serve_error(capsys, ["--enable-hicache", "--hicache-storage-backend", "redis",
                                     "--hicache-storage-url", "foo"])
    assert code == 2 and "--hicache-storage-url" in err


def test_storage_url_without_the_redis_backend_is_refused():
    # before: the URL was ignored and L3 was a temporary file
    with pytest.raises(ValueError, match="--hicache-storage-backend"):
        engine_config(["--enable-hicache", "--hicache-storage-url", "redis://localhost:6379/0"])


def test_storage_path_with_the_redis_backend_is_refused():
    # before: the path was ignored
    with pytest.raises(ValueError, match="--hicache-storage-path"):
        engine_config(["--enable-hicache", "--hicache-storage-backend", "redis", "--hicache-storage-url",
                       "redis://localhost:6379/0", "--hicache-storage-path", "/tmp/l3.kv"])


# -- server-only flags --------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, flag", [
    (["--port", "65536"], "--port"),  # before: served on a random port while the log said 65536
    (["--port", "-1"], "--port"),  # before: the engine was built, then uvicorn's error
    (["--port", "0", "--shutdown-grace-s", "nan"], "--shutdown-grace-s"),  # before: served, with no grace (NaN -> 0)
])
def test_server_flags_out_of_range_are_refused_before_serving(argv, flag):
    proc = serve_subprocess(argv)
    assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr


def test_server_help_states_every_numeric_default():
    parser = serve.build_parser()
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        default = action.default
        if isinstance(default, (int, float)) and not isinstance(default, bool) and default != 0:
            text = formatter._expand_help(action) if action.help else ""
            if f"{default}" not in text and f"{default:,}" not in text:
                missing.append(action.option_strings[0])
    assert not missing, missing


@pytest.mark.parametrize("flag, unit", [
    ("--max-total-tokens", "tokens"), ("--max-prefill-tokens", "tokens"), ("--max-prompt-tokens", "tokens"),
    ("--hicache-storage-size-gb", "GiB"), ("--shutdown-grace-s", "seconds"), ("--max-body-bytes", "bytes"),
    ("--hicache-recompute-us-per-token", "µs"), ("--hicache-host-bandwidth-gib-s", "GiB/s"),
])
def test_server_help_states_units(flag, unit):
    parser = serve.build_parser()
    action = next(a for a in parser._actions if flag in a.option_strings)
    assert unit in (action.help or ""), (flag, action.help)


# -- a page larger than the pool ------------------------------------------------------------------
def test_page_larger_than_the_l1_pool_is_refused():
    # before: accepted, and L1 became one page of 16,384 tokens where --max-total-tokens asked for 8,192
    with pytest.raises(ValueError, match="--page-size.*--max-total-tokens"):
        engine_config(["--page-size", "16384"])
    engine_config(["--page-size", "8192"])  # one page, exactly the pool asked for
    engine_config(["--page-size", "16384", "--num-pages", "1"])  # a pool given in pages holds whole pages


@pytest.mark.parametrize("alias, flag, value, field", [
    ("--gpu-memory-utilization", "--gpu-memory-fraction", "0.5", "gpu_memory_fraction"),
    ("--max-num-seqs", "--max-running-requests", "8", "max_running_requests"),
    ("--max-num-batched-tokens", "--max-prefill-tokens", "512", "max_prefill_tokens"),
    ("--chunked-prefill-size", "--max-prefill-tokens", "256", "max_prefill_tokens"),
])
def test_vllm_s_and_sglang_s_names_of_a_flag_set_the_same_setting(alias, flag, value, field):
    """Session 51: a vLLM or SGLang user's flags (--gpu-memory-utilization, --max-num-seqs, --max-num-batched-tokens,
    --chunked-prefill-size) were "unrecognized arguments"; each now sets what this engine's own name sets."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    by_alias, by_flag = (config_from_args(parser.parse_args([name, value])) for name in (alias, flag))
    assert getattr(by_alias, field) == getattr(by_flag, field) == type(getattr(by_flag, field))(value)
    assert by_alias == by_flag

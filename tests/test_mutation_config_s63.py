"""Mutation check of hicache/config.py and scheduler/logs.py (session 63): the rules no test pinned.
Logs: an event's own ts_ns is kept, a log named by a second path (a symlink) is the same log of this process,
JSON lines carry their level and an exception's traceback, occupancy events carry the tier's capacity, a closed
sink is opened anew.
Config: each refusal's bound and each default the docs and flags rely on."""
from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import structlog
from structlog.testing import capture_logs

from hicache.config import HiCacheConfig
from scheduler import logs
from scheduler.logs import OccupancyLog, configure_logging


@pytest.fixture
def restore_logging():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- scheduler/logs.py ----------------------------------------------------------------------------
def test_an_events_own_timestamp_is_kept(tmp_path, restore_logging):
    """L1: ops.apply logs the time its transition happened (ts_ns=now_ns); the processor only fills in a
    missing one."""
    log = tmp_path / "run.jsonl"
    configure_logging(str(log))
    structlog.get_logger().info("op", ts_ns=5)
    start, op = lines(log)
    assert start["event"] == "run_start" and start["ts_ns"] > 5 and op["ts_ns"] == 5


def test_a_log_named_by_a_symlink_is_this_processs_log(tmp_path, restore_logging):
    """L8: the lock is keyed by the real path: a second engine of this process naming the same file another
    way appends to it (the mutant locked it twice and called this process "another process")."""
    log, link = tmp_path / "run.jsonl", tmp_path / "link.jsonl"
    configure_logging(str(log))
    os.symlink(log, link)
    configure_logging(str(link))
    assert [e["event"] for e in lines(log)] == ["run_start", "run_start"]


def test_json_lines_carry_the_level_and_an_exceptions_traceback(tmp_path, restore_logging):
    """L17, L18: engine_loop_crashed is logged by log.exception(): its line says error and has the traceback."""
    log = tmp_path / "run.jsonl"
    configure_logging(str(log))
    try:
        raise RuntimeError("the loop broke")
    except RuntimeError:
        structlog.get_logger().exception("engine_loop_crashed")
    start, crash = lines(log)
    assert start["level"] == "info" and crash["level"] == "error"
    assert "Traceback" in crash["exception"] and "RuntimeError: the loop broke" in crash["exception"]


def test_occupancy_events_carry_the_tiers_capacity():
    """L19: the timeline draws used against capacity_pages."""
    from hicache.radix import Tier

    with capture_logs() as events:
        OccupancyLog({Tier.L2: SimpleNamespace(num_pages=10, num_free=7)})()
    assert [(e["tier"], e["used_pages"], e["capacity_pages"]) for e in events] == [("l2", 3, 10)]


def test_a_closed_sink_is_opened_anew(tmp_path, restore_logging):
    """L4: a sink of this process closed since (its lock with it) is reopened, not written to closed."""
    log = tmp_path / "run.jsonl"
    configure_logging(str(log))
    logs._SINKS[os.path.realpath(log)].close()
    configure_logging(str(log))
    assert [e["event"] for e in lines(log)] == ["run_start", "run_start"]


# -- hicache/config.py ----------------------------------------------------------------------------
def test_the_flags_defaults_are_the_in_process_apis():
    """C35-C40, C42: an engine configured in process gets what hicache-serve's flags give by default (the README
    states the flags' defaults: --hicache-io-workers 4, --hicache-kernel-restore-max-tokens 4096, ...)."""
    import argparse
    import dataclasses

    from scheduler.config import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    by_flags = config_from_args(parser.parse_args([])).hicache
    assert by_flags == dataclasses.replace(HiCacheConfig(), model_id=by_flags.model_id)
    cfg = HiCacheConfig()
    assert (cfg.io_workers, cfg.kernel_restore_max_tokens, cfg.restore_explore_every) == (4, 4096, 32)


@pytest.mark.parametrize("fields, says", [
    (dict(io_workers=0), "--hicache-io-workers must be >= 1"),  # C3
    (dict(policy="fastest"), "unknown --hicache-policy 'fastest'"),  # C4
    (dict(transfer_backend="cuda"), "unknown --hicache-transfer-backend 'cuda'"),  # C43
    (dict(write_policy="write_around"), "unknown --hicache-write-policy 'write_around'"),  # C44
    (dict(cost_margin=0.0), "--hicache-cost-margin must be a finite number > 0"),  # C10
    (dict(io_timeout_s=math.nan), "hicache.io_timeout_s must be > 0"),  # C12 (NaN: no read would ever time out)
    (dict(host_bandwidth_gib_s=0.0), r"host_bandwidth_gib_s must be > 0 and finite \(--hicache-host-bandwidth"),  # C13
    (dict(storage_url="redis://h:6379/0"), "--hicache-storage-url is only used by --hicache-storage-backend redis"),
    (dict(storage_persist=True), "--hicache-storage-persist keeps a local L3 file: it needs --hicache-storage-path"),
    (dict(storage_persist=True, storage_path="/tmp/l3.bin", storage_checksum=False), "drop --hicache-disable-checksum"),
    (dict(host_ratio=None), "hicache.host_ratio must be a number"),  # C20 (only the _gb sizes may be None)
    (dict(storage_ratio=None), "hicache.storage_ratio must be a number"),
])
def test_a_refused_setting_names_its_flag(fields, says):
    """C14, C17, C18 are the storage_url, the two storage_persist rows."""
    with pytest.raises(ValueError, match=says):
        HiCacheConfig(**fields)


@pytest.mark.parametrize("fields", [
    dict(storage_backend="redis"),  # C5: no URL needed while hicache is off
    dict(storage_explore_reads=0, host_explore_transfers=0, restore_explore_every=0, kernel_restore_max_tokens=0),
    dict(host_size_gb=0.0, storage_size_gb=0.0),  # C11: 0 is a size (no L3)
    dict(enable=True, storage_backend="redis", storage_url="unix:///run/redis.sock"),  # C30
    dict(enable=True, storage_backend="redis", storage_url="redis://h:6379/3"),
])
def test_a_documented_edge_value_is_taken(fields):
    """C6-C9: 0 is each explore count's "the prior decides" / "never", the kernel's "only the fragmented"."""
    cfg = HiCacheConfig(**fields)
    assert all(getattr(cfg, k) == v for k, v in fields.items())


@pytest.mark.parametrize("url, says", [
    ("unix://", "a unix:// URL needs a socket path"),  # C31
    ("redis://h:6379/x", "the database must be a number >= 0, got 'x'"),  # C32
    ("redis://h:6379/0?socket_timeout=abc", "not a redis URL"),  # C33: the client's own parse
    ("redis://h:port/0", "not a redis URL"),  # C34
])
def test_a_redis_url_the_client_would_refuse_is_refused_at_once(url, says):
    with pytest.raises(ValueError, match=f"--hicache-storage-url: .*{says}"):
        HiCacheConfig(enable=True, storage_backend="redis", storage_url=url)


def test_tier_sizes_in_pages():
    """C24-C29: GiB are 2**30 bytes; a size of 0 wins over the ratio (no L2 / no L3) and is no error; pages
    are whole (truncated, not rounded); a tier may have exactly MAX_TIER_PAGES."""
    from hicache.config import MAX_TIER_PAGES

    assert HiCacheConfig(host_size_gb=1.0).host_pages(8, 1 << 20) == 1024
    assert HiCacheConfig(host_size_gb=0.0).host_pages(8, 4096) == 0
    assert HiCacheConfig(storage_size_gb=0.0).storage_pages(16, 4096) == 0
    assert HiCacheConfig(storage_ratio=0.0).storage_pages(16, 4096) == 0
    assert HiCacheConfig(host_ratio=0.6).host_pages(3, 4096) == 1  # 1.8 pages
    assert HiCacheConfig(host_ratio=1.0).host_pages(MAX_TIER_PAGES, 4096) == MAX_TIER_PAGES
    with pytest.raises(ValueError, match="more than the"):
        HiCacheConfig(host_ratio=1.0).host_pages(MAX_TIER_PAGES + 1, 4096)

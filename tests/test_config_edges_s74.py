"""Configured numbers at their edges (session 74's hunt): NaN, inf, a negative, 0, a float or a bool where an integer is
meant, a string number, given through the in-process API. Each is refused at construction naming its field, not
taken and failing later. What earlier sessions pinned (tests/test_mutation_config_s63.py, test_cli_errors.py,
test_raise_cli_s70.py: the engine's and the cache's fields, the flags) is not repeated.
- HiCacheConfig.io_timeout_s: inf passed its `> 0` check and turned off the L3 read deadline (operations.py
  `_io_deadline_s`: min(4 x inf, ...) is inf), so a read on a hung storage waited for good, as NaN's did.
- HiCacheConfig.storage_url's socket_timeout / socket_connect_timeout (the client's URL options win over the
  store's own 5 s / 2 s): 0 or a negative timed every command out (L3 logged "unreachable", never used), NaN or inf
  left a hung server's commands without a socket timeout.
- ServerLimits (create_app's in-process API; hicache-serve checks its flags in serve.py) checked nothing: a NaN
  shutdown_grace_s aborted every in-flight request at once (`time.monotonic() < nan` is False), a NaN
  max_concurrent_requests admitted any number (`in_flight + n > nan` is False), a max_body_bytes of 0 refused every
  body (413), a default_max_tokens of 0 refused every request leaving max_tokens out, naming a field it did not
  send, and a responses_store_max_mib of 2.5 or "8" was a TypeError inside create_app."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hicache.config import HiCacheConfig
from scheduler.server import ServerLimits


@pytest.mark.parametrize("timeout_s", [math.inf, -math.inf, math.nan, 0.0])
def test_an_l3_read_timeout_must_be_finite(timeout_s):
    with pytest.raises(ValueError, match=r"hicache\.io_timeout_s must be > 0 and finite"):
        HiCacheConfig(io_timeout_s=timeout_s)


def test_a_large_finite_l3_read_timeout_is_taken():
    assert HiCacheConfig(io_timeout_s=1e9).io_timeout_s == 1e9


@pytest.mark.parametrize("key", ["socket_timeout", "socket_connect_timeout"])
@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "inf"])
def test_a_redis_urls_timeout_must_be_finite_and_positive(key, seconds):
    with pytest.raises(ValueError, match=rf"--hicache-storage-url: .*{key} must be a finite number of seconds > 0"):
        HiCacheConfig(enable=True, storage_backend="redis", storage_url=f"redis://h:6379/0?{key}={seconds}")


def test_a_redis_urls_positive_timeouts_are_taken():
    url = "unix:///run/redis.sock?socket_timeout=0.5&socket_connect_timeout=30"
    assert HiCacheConfig(enable=True, storage_backend="redis", storage_url=url).storage_url == url


@pytest.mark.parametrize("field, value", [
    ("shutdown_grace_s", math.nan), ("shutdown_grace_s", "10"), ("shutdown_grace_s", True),
    ("max_concurrent_requests", math.nan), ("max_concurrent_requests", 0), ("max_concurrent_requests", 2.5),
    ("max_concurrent_requests", True), ("max_concurrent_requests", "8"),
    ("max_body_bytes", 0), ("max_body_bytes", -1), ("max_body_bytes", math.inf),
    ("default_max_tokens", 0), ("default_max_tokens", math.nan),
    ("max_prompt_tokens", -1), ("max_prompt_tokens", 2.5), ("max_tokens_limit", -1), ("max_tokens_limit", math.nan),
    ("responses_store_max", -1), ("responses_store_max", 2.5),
    ("responses_store_max_mib", 0), ("responses_store_max_mib", 2.5), ("responses_store_max_mib", "8"),
])
def test_a_server_limit_out_of_range_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"ServerLimits\.{field} must be"):
        ServerLimits(**{field: value})


def test_a_server_limits_documented_edges_are_taken():
    """0 is "the engine's" for the two token limits and "none kept" for the store; a negative grace is none (as
    --shutdown-grace-s's), an infinite one waits for every request; numpy's integers are taken as Python's."""
    limits = ServerLimits(max_prompt_tokens=0, max_tokens_limit=0, responses_store_max=0, shutdown_grace_s=-1.0,
                          max_concurrent_requests=np.int64(3), max_body_bytes=1, default_max_tokens=1,
                          responses_store_max_mib=1)
    assert type(limits.max_concurrent_requests) is int and limits.max_concurrent_requests == 3
    assert ServerLimits(shutdown_grace_s=math.inf).shutdown_grace_s == math.inf

"""Configuration of the cache hierarchy: a frozen dataclass passed in, never a global."""
from __future__ import annotations

import math
import numbers
import os
import urllib.parse
from dataclasses import dataclass
from typing import Literal

Policy = Literal["cost", "always", "never"]
WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
TransferBackend = Literal["auto", "triton", "torch"]
StorageBackend = Literal["file", "redis"]

# Most pages one tier may have: L1 and L2 page ids travel as int32 to the copy kernels
# (hicache/transfer.py), and a size past it is a typo (1e30 GiB crashed the pools' allocation).
MAX_TIER_PAGES = (1 << 31) - 1
REDIS_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class HiCacheConfig:
    enable: bool = False
    # L2 capacity: ratio x L1 pages, or an absolute size (wins when given)
    host_ratio: float = 2.0
    host_size_gb: float | None = None
    # L3 capacity: ratio x L2 pages, or an absolute size (wins when given); 0 disables L3
    storage_ratio: float = 2.0
    storage_size_gb: float | None = None
    storage_path: str | None = None
    storage_backend: StorageBackend = "file"
    storage_url: str | None = None
    storage_checksum: bool = True
    # the L3 file outlives the engine: its index saved at a clean close, adopted by the next engine on the
    # same path (hicache/l3_index.py); needs storage_path and checksums
    storage_persist: bool = False
    io_workers: int = 4
    io_timeout_s: float = 30.0  # an L3 read or write slower than this and 4x its prediction (at most 4x this) fails
    policy: Policy = "cost"
    write_policy: WritePolicy = "write_through"
    transfer_backend: TransferBackend = "auto"
    # layer-ordered L2 restores of at most this many tokens go by the copy kernel that reads pinned L2
    # over PCIe (kernels/host_copy.py: one launch) instead of the copy engine (2 DMAs + a flag write per
    # layer); fragmented ones, and slabs too narrow for 2-D DMAs, always do; 0: only those. On the
    # H200 the kernel's enqueue takes 0.2-0.35 ms of host time before the forward may launch against
    # 0.65-0.94 for the DMAs.
    # Session 5 (16 programs) saw the kernel's lower bandwidth lose from 2,000 tokens; session 26's
    # probe, beside the forward, had even 16 programs ahead of the DMAs at 2,000 / 3,500 tokens (7.0 /
    # 11.25 ms against 7.2 / 12.0), 64 more so (6.27 at 2,000), and a forced L2 restore took 7.00 /
    # 11.78 ms at 2,000 / 3,500 tokens against 7.73-8.07 / 12.06-12.54 by the DMAs
    # (docs/benchmarks.md; nothing timed between 3,500 and 4,096). Longer ones keep the DMAs, which
    # move a restore longer than its forward partly whole (`whole_first`)
    kernel_restore_max_tokens: int = 4096
    # at start, time a restore by the copy kernel against one by the DMAs, and where the kernel is the slower
    # (a host whose SMs read pinned memory slowly) lower the bound above (hicache/kernel_calibration.py)
    kernel_calibration: bool = True
    # a layer-ordered restore longer than its forward moves the pages the forward does not wait on
    # first, whole, at the pinned copy's rate (CacheManager.whole_first_pages); False: all in layers
    whole_first: bool = True
    prefetch: bool = True  # False: blocking restores (--disable-hicache-prefetch)
    # cost-model priors
    recompute_us_per_token: float = 50.0
    host_bandwidth_gib_s: float = 12.0
    storage_bandwidth_gib_s: float = 3.0
    cost_margin: float = 1.0
    # cost policy: charge each restore source what its requests took end to end beyond the model's
    # price, measured on requests that ran alone (hicache/outcomes.py); False: the transfers' price only
    learn_outcomes: bool = True
    # cost policy: until this many storage reads were timed, L3 writes are admitted and L3 hits restored
    # whatever the prior says, so the model learns this machine's storage speed (0: the prior decides)
    storage_explore_reads: int = 2
    # cost policy: until this many L1 <-> L2 transfers were timed each way, L2 backups are admitted and
    # L2 hits restored whatever the prior says (host_bandwidth_gib_s may be far off); 0: the prior decides
    host_explore_transfers: int = 1
    # cost policy: after this many hits in a row not restored from a tier, the next one is, and after
    # this many refused writes to a tier the next one goes through, so the model re-times a tier it
    # may be wrong about (a skipped restore, an unwritten tier, is never timed); 0: never
    restore_explore_every: int = 32
    # model identity salt for content-addressed (shared) storage keys
    model_id: str = "unknown"

    def __post_init__(self) -> None:
        self._check_types()
        for name, flag in (("host_ratio", "--hicache-ratio"), ("storage_ratio", "--hicache-storage-ratio")):
            ratio = getattr(self, name)
            if not 0 <= ratio < math.inf:  # (NaN and inf too: int(inf) crashed the pools' sizing)
                raise ValueError(f"hicache.{name} ({flag}) must be a finite number >= 0, got {ratio!r}")
        if self.io_workers < 1:
            raise ValueError("--hicache-io-workers must be >= 1")
        if self.policy not in ("cost", "always", "never"):
            raise ValueError(f"unknown --hicache-policy {self.policy!r}")
        if self.write_policy not in ("write_through", "write_through_selective", "write_back"):
            raise ValueError(f"unknown --hicache-write-policy {self.write_policy!r}")
        if self.transfer_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"unknown --hicache-transfer-backend {self.transfer_backend!r}")
        if self.storage_backend not in ("file", "redis"):
            raise ValueError(f"unknown --hicache-storage-backend {self.storage_backend!r}")
        if self.storage_backend == "redis" and self.enable and not self.storage_url:
            raise ValueError("--hicache-storage-backend redis needs --hicache-storage-url redis://HOST:PORT/DB")
        if self.storage_explore_reads < 0:
            raise ValueError("--hicache-storage-explore-reads must be >= 0")
        if self.host_explore_transfers < 0:
            raise ValueError("--hicache-host-explore-transfers must be >= 0")
        if self.restore_explore_every < 0:
            raise ValueError("--hicache-restore-explore-every must be >= 0")
        if self.kernel_restore_max_tokens < 0:
            raise ValueError("--hicache-kernel-restore-max-tokens must be >= 0")
        if not 0 < self.cost_margin < math.inf:  # (a NaN margin never restored)
            raise ValueError(f"--hicache-cost-margin must be a finite number > 0, got {self.cost_margin!r}")
        for name, flag in (("host_size_gb", "--hicache-size-gb"), ("storage_size_gb", "--hicache-storage-size-gb")):
            size_gb = getattr(self, name)
            if size_gb is not None and not 0 <= size_gb < math.inf:  # (negative: no tier; NaN, inf: a crash)
                raise ValueError(f"hicache.{name} ({flag}) must be a finite number >= 0, got {size_gb!r}")
        if not 0 < self.io_timeout_s < math.inf:  # (NaN, inf: an L3 read on a hung storage never timed out)
            raise ValueError(f"hicache.io_timeout_s must be > 0 and finite, got {self.io_timeout_s!r}")
        for name, flag in (("recompute_us_per_token", "--hicache-recompute-us-per-token"),
                           ("host_bandwidth_gib_s", "--hicache-host-bandwidth-gib-s"),
                           ("storage_bandwidth_gib_s", "--hicache-storage-bandwidth-gib-s")):
            value = getattr(self, name)
            if not 0 < value < math.inf:  # (0, NaN: the cost model refused them naming no flag; inf: free)
                raise ValueError(f"hicache.{name} must be > 0 and finite ({flag}), got {value!r}")
        if self.storage_url is not None and self.storage_backend != "redis":
            raise ValueError("--hicache-storage-url is only used by --hicache-storage-backend redis "
                             f"(the backend is {self.storage_backend!r})")
        if self.storage_path == "":  # (regression: an unset variable's "" was taken as the current directory)
            raise ValueError("--hicache-storage-path is empty: give a file's path, or leave it out for a "
                             "temporary file")
        if self.storage_path is not None and self.storage_backend != "file":
            raise ValueError("--hicache-storage-path is only used by --hicache-storage-backend file "
                             f"(the backend is {self.storage_backend!r})")
        if self.storage_backend == "redis" and self.storage_url:
            _check_redis_url(self.storage_url)
        if self.storage_persist and (self.storage_backend != "file" or self.storage_path is None):
            raise ValueError("--hicache-storage-persist keeps a local L3 file: it needs --hicache-storage-path "
                             "(and the file backend; a Redis L3 outlives the engine anyway)")
        no_l3 = self.storage_size_gb == 0 or self.storage_size_gb is None and self.storage_ratio == 0
        if self.storage_persist and no_l3:  # (regression: the engine started with no L3, nothing kept, without a word)
            raise ValueError("--hicache-storage-persist keeps the L3 file: it needs an L3, but "
                             "--hicache-storage-ratio / --hicache-storage-size-gb of 0 asks for none")
        if self.storage_persist and not self.storage_checksum:
            raise ValueError("--hicache-storage-persist needs the L3 checksums (every page adopted from an "
                             "earlier run is verified as it is read): drop --hicache-disable-checksum")

    def _check_types(self) -> None:
        """What the in-process API may be given that the flags' parser never makes: a ValueError naming the field
        (regression: enable="false" turned the tiers on, a host_ratio of "2" was a TypeError from a comparison, an
        io_workers of 2.5 failed the engine's start inside its thread pool); numpy's numbers taken as Python's."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(f"hicache.{name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in _REAL_FIELDS:
            value = getattr(self, name)
            if value is None and name.endswith("_gb"):
                continue
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"hicache.{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"hicache.{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.storage_path, os.PathLike):  # (a pathlib.Path, as its text)
            object.__setattr__(self, "storage_path", os.fspath(self.storage_path))
        for name in ("storage_path", "storage_url", "model_id"):
            value = getattr(self, name)
            if not (isinstance(value, str) or value is None and name != "model_id"):
                raise ValueError(f"hicache.{name} must be a string, got {value!r}")

    def host_pages(self, l1_pages: int, bytes_per_page: int) -> int:
        if self.host_size_gb is not None:
            pages, flag = _pages_in(self.host_size_gb * (1 << 30), bytes_per_page), "--hicache-size-gb"
        else:
            pages, flag = _pages_in(l1_pages * self.host_ratio, 1), "--hicache-ratio"
        return _check_tier_pages("L2", pages, flag, bytes_per_page)

    def storage_pages(self, host_pages: int, bytes_per_page: int) -> int:
        """L3 pages; 0 (no L3) only when a capacity of 0 was asked for: a positive ratio or size
        too small for one page is refused (it used to turn L3 off without a word)."""
        if self.storage_size_gb is not None:
            asked, flag = self.storage_size_gb, "--hicache-storage-size-gb"
            pages = _pages_in(self.storage_size_gb * (1 << 30), bytes_per_page)
        else:
            asked, flag = self.storage_ratio, "--hicache-storage-ratio"
            pages = _pages_in(host_pages * self.storage_ratio, 1)
        if asked > 0 and pages < 1:
            raise ValueError(f"hicache: L3 would hold no page of {bytes_per_page:,} bytes; raise {flag} "
                             f"(or give 0 for no L3)")
        return _check_tier_pages("L3", pages, flag, bytes_per_page)


_INT_FIELDS = ("io_workers", "kernel_restore_max_tokens", "storage_explore_reads", "host_explore_transfers",
               "restore_explore_every")
_REAL_FIELDS = ("host_ratio", "host_size_gb", "storage_ratio", "storage_size_gb", "io_timeout_s",
                "recompute_us_per_token", "host_bandwidth_gib_s", "storage_bandwidth_gib_s", "cost_margin")
_BOOL_FIELDS = ("enable", "storage_checksum", "storage_persist", "whole_first", "prefetch", "learn_outcomes",
                "kernel_calibration")


def _pages_in(amount: float, per_page: int) -> int:
    """Whole pages of `per_page` in `amount` (bytes, or pages with per_page 1); an amount past float's
    range counts as one page more than a tier can have, so `_check_tier_pages` refuses it naming its
    flag (regression: --hicache-size-gb 1e300 was an OverflowError traceback)."""
    return int(amount) // per_page if amount < math.inf else MAX_TIER_PAGES + 1


def _check_tier_pages(tier: str, pages: int, flag: str, bytes_per_page: int) -> int:
    if pages > MAX_TIER_PAGES:
        raise ValueError(f"hicache: {flag} gives {tier} {pages:,} pages of {bytes_per_page:,} bytes, more than "
                         f"the {MAX_TIER_PAGES:,} a tier can have")
    return pages


def _check_redis_url(url: str) -> None:
    """What the redis client would refuse (or misread: a database of "x" was db 0), naming the flag;
    the URL itself is not echoed (it may carry a password)."""
    problem = None
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in REDIS_SCHEMES:
            problem = f"the scheme must be one of {', '.join(s + '://' for s in REDIS_SCHEMES)}"
        elif parts.scheme == "unix":
            if not parts.path:
                problem = "a unix:// URL needs a socket path"
        else:
            parts.port  # noqa: B018  (raises ValueError: not a number, or out of range)
            db = parts.path.lstrip("/")
            if db and not (db.isascii() and db.isdigit()):
                problem = f"the database must be a number >= 0, got {db!r}"
        if problem is None:
            # its query's options as the client reads them (regression: "?db=x" and "?socket_timeout=abc" passed,
            # then stopped the engine's start)
            from redis.connection import parse_url
            options = parse_url(url)
            for key in ("socket_timeout", "socket_connect_timeout"):  # (they win over the store's own: 0 or less
                # timed every command out, L3 "unreachable"; NaN, inf: no socket timeout, a hung server's waited on)
                if key in options and not 0 < options[key] < math.inf:
                    problem = f"{key} must be a finite number of seconds > 0, got {options[key]!r}"
    except ValueError as exc:
        problem = str(exc)
    if problem:
        raise ValueError(f"--hicache-storage-url: not a redis URL (redis://[:PASSWORD@]HOST[:PORT][/DB]): {problem}")

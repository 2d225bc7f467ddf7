"""The replay's command line: its flags on top of the engine's (scheduler.config.add_engine_args),
their defaults for the bundled sample and for a user's trace, the checks that refuse an option out of
range (exit 2), and the EngineConfig they make, capacities in tokens or GiB turned into the engine's
sizes. scheduler/replay.py runs the replay; its docstring is the command's help."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hicache.config import MAX_TIER_PAGES
from scheduler import replay_memory
from scheduler.config import (HICACHE_NEEDS_PREFIX_CACHE, EngineConfig, add_engine_args, config_from_args,
                              resolve_device)
from scheduler.presets import model_config_of
from scheduler.replay_memory import flag_name as _flag

# beside this module, so that a wheel carries it (pyproject's package-data; regression: looked for in the
# checkout's data/, an installed hicache-replay without --trace found nothing in site-packages)
SAMPLE_TRACE = Path(__file__).resolve().with_name("sample_trace.jsonl")
GIB = 1 << 30
REPLAY_OPTIONS = ("trace", "block_tokens", "time_scale", "max_requests", "max_input_tokens", "max_output_tokens",
                  "concurrency", "strict", "simulate", "synth_seed", "l1_tokens", "l1_gib", "l2_tokens", "l2_gib",
                  "l3_tokens", "l3_gib")
# Replay options whose default depends on whether the bundled sample or a user's trace is replayed.
SAMPLE_DEFAULTS = dict(device="cpu", block_tokens=16, max_requests=200, max_output_tokens=32, time_scale=0.0,
                       concurrency=1, l1_tokens=4096, l2_tokens=24576, l3_tokens=65536)
TRACE_DEFAULTS = dict(device="auto", block_tokens=512, max_requests=None, max_output_tokens=None, time_scale=1.0,
                      concurrency=64, l1_tokens=None, l2_tokens=None, l3_tokens=None)
# The smallest valid value of each replay option that has one (None, not given, is always valid).
REPLAY_MINIMUMS = dict(block_tokens=1, concurrency=1, max_requests=1, max_input_tokens=1, max_output_tokens=1,
                       time_scale=0, l1_tokens=1, l2_tokens=1, l3_tokens=0, l3_gib=0, synth_seed=0)
POSITIVE_OPTIONS = ("l1_gib", "l2_gib")  # capacities that must be > 0 (0 is no L3 only for L3)


# -- arguments -> configuration -------------------------------------------------------------------
class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False):  # no default, a flag, or one that depends on --trace
            return action.help or ""
        return super()._get_help_string(action)


def build_parser(description: str | None = None,
                 own_args: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.ArgumentParser:
    """The replay's parser; `own_args` adds a script's own flags, listed before the replay's. Its prog is
    argparse's, the name the user ran (regression: forced to replay_trace.py, also for hicache-replay
    and probe_start.py)."""
    p = argparse.ArgumentParser(description=description, formatter_class=_HelpFormatter)
    if own_args is not None:
        own_args(p)
    add_engine_args(p)
    # the replay's engine defaults: all tiers on, 16-token pages (one sample block per page); the
    # device is the CPU for the sample and auto for --trace
    # (enable_hicache None: on, unless --disable-prefix-cache turns it off; config_from_replay_args)
    p.set_defaults(enable_hicache=None, device=None, page_size=16)
    # (regression: its help was the engine's, "default 16 on cuda, 4 on cpu", beside "(default: 16)")
    next(a for a in p._actions if a.dest == "page_size").help = "tokens per page, on every device"
    p.add_argument("--disable-hicache", action="store_true",
                   help="turn L2/L3 off (the replay enables them unless --disable-prefix-cache is given)")
    r = p.add_argument_group("replay (defaults in [sample | --trace] form where they differ)")
    r.add_argument("--trace", default=None, help=f"Mooncake JSONL trace [{SAMPLE_TRACE.name}]")
    r.add_argument("--block-tokens", type=int, default=None, help="tokens per hash id [16 | 512]")
    r.add_argument("--time-scale", type=float, default=None,
                   help="arrival-time multiplier, 0 = as fast as possible [0 | 1]")
    r.add_argument("--max-requests", type=int, default=None, help="replay the first N good records [200 | all]")
    r.add_argument("--max-input-tokens", type=int, default=None, help="clip prompts to N tokens")
    r.add_argument("--max-output-tokens", type=int, default=None, help="clip outputs to N tokens [32 | none]")
    r.add_argument("--concurrency", type=int, default=None,
                   help="max in-flight requests; 1 also drains cache operations between requests [1 | 64]")
    r.add_argument("--strict", action="store_true", help="reject a trace with any malformed line")
    r.add_argument("--json-out", default=None,
                   help="write the summary, with a record per request (request_records), as JSON here")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--simulate", action="store_true", help="no model, no KV bytes: scheduler + cache bookkeeping")
    r.add_argument("--compare-no-cache", action="store_true",
                   help="also replay with every cache off and compare outputs_digest")
    r.add_argument("--synth-seed", type=int, default=0, help="seed of the hash-id -> token-block synthesis")
    c = p.add_argument_group("capacities (win over --num-pages / --hicache-*size*; sample: 4096/24576/65536 tokens)")
    c.add_argument("--l1-tokens", type=int, default=None, help="L1 capacity in tokens")
    c.add_argument("--l1-gib", type=float, default=None, help="L1 capacity in GiB")
    c.add_argument("--l2-tokens", type=int, default=None, help="L2 capacity in tokens")
    c.add_argument("--l2-gib", type=float, default=None, help="L2 capacity in GiB")
    c.add_argument("--l3-tokens", type=int, default=None, help="L3 capacity in tokens (0: no L3)")
    c.add_argument("--l3-gib", type=float, default=None, help="L3 capacity in GiB (0: no L3)")
    return p


def fill_defaults(args: argparse.Namespace) -> None:
    """Sample defaults without --trace, a user's trace's defaults with it; explicit flags win. An
    explicit pool size (--num-pages, --max-total-tokens, --hicache-*) or GiB flag turns off the
    matching sample capacity."""
    defaults = SAMPLE_DEFAULTS if args.trace is None else TRACE_DEFAULTS
    engine_defaults = vars(build_parser().parse_args([]))
    changed = lambda *keys: any(getattr(args, k) != engine_defaults[k] for k in keys)  # noqa: E731
    explicit = {"l1_tokens": changed("num_pages", "max_total_tokens", "l1_gib"),
                "l2_tokens": changed("hicache_size_gb", "hicache_ratio", "l2_gib"),
                "l3_tokens": changed("hicache_storage_size_gb", "hicache_storage_ratio", "l3_gib")}
    for key, value in defaults.items():
        if getattr(args, key) is None and not explicit.get(key, False):
            setattr(args, key, value)
    if args.trace is None:
        args.trace = str(SAMPLE_TRACE)


def check_replay_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses replay options out of range (exit code 2) rather than clipping or ignoring them."""
    for key, minimum in REPLAY_MINIMUMS.items():
        value = getattr(args, key)
        if value is not None and not minimum <= value < math.inf:  # also refuses NaN and inf
            parser.error(f"{_flag(key)} must be >= {minimum} and finite, got {value}")
    for key in POSITIVE_OPTIONS:
        value = getattr(args, key)
        if value is not None and not 0 < value < math.inf:
            parser.error(f"{_flag(key)} must be > 0 and finite, got {value}")
    for tokens, gib in (("l1_tokens", "l1_gib"), ("l2_tokens", "l2_gib"), ("l3_tokens", "l3_gib")):
        if getattr(args, tokens) is not None and getattr(args, gib) is not None:  # (regression: one won, by tier)
            parser.error(f"{_flag(tokens)} and {_flag(gib)} both size {tokens[:2].upper()}: give one")
    if args.disable_hicache and args.enable_hicache:  # (regression: the disable won without a word)
        parser.error("--enable-hicache and --disable-hicache: give one")


def check_writable(parser: argparse.ArgumentParser, path: str | None, key: str) -> None:
    """Creates an output file's directory before the replay runs; refuses one it cannot write into: the file opened
    for appending, as its writer will (regression: os.access proved nothing to root, or of a read-only file, and the
    replay ran to its end, then lost its summary to a traceback)."""
    if path is None:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"{_flag(key)}: cannot create the directory of {path}: {exc.strerror or exc}")
    if Path(path).is_dir():
        parser.error(f"{_flag(key)}: cannot write {path}: a directory")
    existed = Path(path).exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        parser.error(f"{_flag(key)}: cannot write {path}: {exc.strerror or exc}")
    if not existed:
        Path(path).unlink(missing_ok=True)


def config_from_replay_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the engine flags plus --simulate, --disable-hicache and the capacity flags
    (tokens -> pages of this geometry; GiB stay GiB, sized exactly as the engine sizes them).
    Hicache is on unless --disable-hicache or --disable-prefix-cache (said on stderr) turns it off."""
    if args.disable_hicache:
        args.enable_hicache = False
    elif args.disable_prefix_cache:
        if args.enable_hicache:  # given (not given it is None)
            raise ValueError("--enable-hicache cannot be used with --disable-prefix-cache: "
                             + HICACHE_NEEDS_PREFIX_CACHE)
        if args.enable_hicache is None:
            print(f"{os.path.basename(sys.argv[0])}: --disable-prefix-cache: L2 and L3 are off too (they only serve "
                  "prefix-cache hits)", file=sys.stderr)
        args.enable_hicache = False
    elif args.enable_hicache is None:
        args.enable_hicache = True
    cfg = dataclasses.replace(config_from_args(args), simulate=args.simulate)
    if args.simulate and cfg.speculative is not None:  # (the engine makes no speculator without a model)
        print(f"{os.path.basename(sys.argv[0])}: --speculative-config: ignored under --simulate (no model to verify "
              "drafts with)", file=sys.stderr)
    if args.simulate and cfg.dtype == "auto":  # the simulated deployment is a GPU one: bf16 KV
        cfg = dataclasses.replace(cfg, dtype="bfloat16")
    device, dtype = resolve_device(cfg)
    page_size = cfg.page_size_on(device.type)  # the engine's default
    geometry = model_config_of(cfg.model).kv_geometry(page_size, dtype)
    bpp = geometry.bytes_per_page
    l1 = _capacity_pages(args, "L1", geometry)
    if l1 is not None:
        cfg = dataclasses.replace(cfg, num_pages=l1[1])
    hc = {}
    for tier, key in (("L2", "host_size_gb"), ("L3", "storage_size_gb")):
        given = _capacity_pages(args, tier, geometry)
        if given is None:
            continue
        # a size in GiB is sized by the engine itself; pages * bpp / 2^30 is exact in binary floating point
        hc[key] = float(getattr(args, given[0])) if given[0].endswith("_gib") else given[1] * bpp / GIB
    cfg = cfg.with_hicache(**hc) if hc else cfg
    if cfg.simulate:
        replay_memory.check_simulated_memory(args, cfg)
        if cfg.hicache.storage_persist:  # (its L3 is bookkeeping only: no file is opened, kept or adopted)
            print(f"{os.path.basename(sys.argv[0])}: --simulate: --hicache-storage-persist keeps nothing (no L3 file "
                  "is opened)", file=sys.stderr)
    return cfg


def shown(value: object) -> str:
    """A value for an error message: a 400-digit integer is not spelled out."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


def _capacity_pages(args: argparse.Namespace, tier: str, geometry) -> tuple[str, int] | None:
    """(option, pages) of the replay's capacity option for `tier` that wins (replay_memory's order),
    None if none is given. A positive size of no page, or more pages than a tier can have, is refused
    naming that option (regression: --l3-gib 1e300 or --l2-tokens 10**400 was an OverflowError
    traceback, and --l3-gib 1e-7 or 1e12 was refused naming --hicache-storage-size-gb, which the
    user had not given)."""
    key = next((k for k in replay_memory.TIER_SIZE_OPTIONS[tier][:2] if getattr(args, k) is not None), None)
    if key is None:
        return None
    value, bpp = getattr(args, key), geometry.bytes_per_page
    if key.endswith("_tokens"):
        pages = geometry.pages_for_tokens(value)
    else:
        num_bytes = value * GIB
        pages = int(num_bytes) // bpp if num_bytes < math.inf else MAX_TIER_PAGES + 1
    if pages < 1 and value > 0:
        raise ValueError(f"{_flag(key)} {value} holds no page of {bpp:,} bytes"
                         + (" (0: no L3)" if tier == "L3" else ""))
    if pages > MAX_TIER_PAGES:
        raise ValueError(f"{_flag(key)} {shown(value)}: more than the {MAX_TIER_PAGES:,} pages a tier can have "
                         f"({geometry.page_size} tokens, {bpp:,} bytes a page)")
    return key, pages

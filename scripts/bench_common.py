"""Shared helpers of the benchmarks and probes next to it (not a benchmark itself).

- arguments: the flags most scripts take (add_common_args), the hicache benchmarks' engine modes;
- statistics: percentiles, millisecond summaries, before/after deltas of `engine.metrics()`;
- engine plumbing: one loaded model shared by several Engines in one process, tier eviction,
  one timed request, integrity as a string;
- same-run physical limits: plain pinned H2D / D2H `copy_` of a byte count, and a raw sequential
  multi-threaded `os.preadv` read of the same bytes from a file next to the L3 file (cold or warm);
- output: JSON to stdout / a file, human tables to stdout (or stderr when stdout carries JSON).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # runnable without the editable install

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cli import BenchDir, non_negative_int  # noqa: E402,F401  (moved there; imported from here too)

GIB = float(1 << 30)
DIRECTIONS = ("d2h", "h2d", "h2s", "s2h")
TIERS = ("l1", "l2", "l3")
CPU_SMOKE = "cpu-smoke"  # add_common_args(model=...): qwen3-8b on CUDA, tiny on the CPU


# -- statistics -----------------------------------------------------------------------------------
def percentile(values, q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values) -> float | None:
    return percentile(values, 50)


def ms_summary(seconds, quantiles=(50,)) -> dict:
    """{p50.., mean, min, max, n} in milliseconds of a list of seconds."""
    ms = [s * 1e3 for s in seconds]
    out = {f"p{q}": percentile(ms, q) for q in quantiles}
    out.update(mean=sum(ms) / len(ms) if ms else None, min=min(ms) if ms else None,
               max=max(ms) if ms else None, n=len(ms))
    return out


def metrics_delta(after, before):
    """after - before for every number of a (nested) metrics dict; other values are taken from after."""
    if isinstance(after, dict):
        return {k: metrics_delta(v, before.get(k) if isinstance(before, dict) else None) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool) and isinstance(before, (int, float)):
        return after - before
    return after


def directions_summary(delta: dict) -> dict:
    """Per direction: bytes, count, recurring seconds and GiB/s over a metrics delta."""
    out = {}
    for d in DIRECTIONS:
        s = delta["directions"][d]
        rec = s["recurring_s"]
        out[d] = {"bytes": int(s["bytes"]), "count": int(s["count"]), "recurring_s": rec,
                  "gib_s": (s["bytes"] / GIB / rec) if rec > 0 else None, "extents": int(s["extents"])}
    return out


def fmt(x, spec: str = "{:.2f}", none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return spec.format(x)


def fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


@contextlib.contextmanager
def host_profile(label: str, into: dict, top: int = 25):
    """cProfile of the code inside (the loop thread's Python, where a request's host time goes):
    prints the top `top` functions by own time to stderr and stores them in `into["host_profile"]`
    as [{"function", "calls", "own_ms", "cum_ms"}]."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        stats = pstats.Stats(prof).stats  # {(file, line, name): (prim_calls, calls, own_s, cum_s, callers)}

        def rows(items, column: int, count: int):
            """The `count` largest by own (column 2) or inclusive (column 3) time."""
            return [{"function": f"{Path(f).name}:{line}({name})", "calls": c, "own_ms": own * 1e3, "cum_ms": cum * 1e3}
                    for (f, line, name), (_, c, own, cum, _) in sorted(items, key=lambda kv: -kv[1][column])[:count]]
        into["host_profile"] = rows(stats.items(), 2, top)
        # the project's own functions by inclusive time: which stage of a request the time is in
        ours = [kv for kv in stats.items() if any(d in kv[0][0] for d in ("/scheduler/", "/hicache/", "/kernels/"))]
        into["host_profile_stages"] = rows(ours, 3, 2 * top)
        note(f"host profile, {label} (own ms, calls, function):")
        for r in into["host_profile"]:
            note(f"  {r['own_ms']:9.2f} {r['calls']:7d}  {r['function']}")
        note(f"host profile, {label}, project functions by inclusive time (cum ms, calls, function):")
        for r in into["host_profile_stages"]:
            note(f"  {r['cum_ms']:9.2f} {r['calls']:7d}  {r['function']}")


def note(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def emit(result, as_json: bool, out_path: str | None, human: str) -> None:
    """JSON (pure, on stdout) with --json, always to --out when given; the human table last (stderr if JSON is out)."""
    text = json.dumps(result, indent=2, default=str)
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(text + "\n")
    if as_json:
        print(text, flush=True)
    print(human, file=sys.stderr if as_json else sys.stdout, flush=True)


# -- engine plumbing -------------------------------------------------------------------------------
def add_common_args(p, *, model: str | None = None, device: bool | tuple[str, ...] = False,
                    page_size: int | None = None, seed: int | None = None, output: bool = True) -> None:
    """The flags most scripts here take, each only where asked (None / False: not taken): --model with
    default `model` (CPU_SMOKE: set by parse_common_args), --device (True: any torch device, a tuple: one
    of those; default cuda where available), --page-size (0: the engine's), --seed; `output`: --json, --out."""
    if model is not None:
        shown = "qwen3-8b on CUDA, tiny on the CPU" if model == CPU_SMOKE else model
        p.add_argument("--model", default=None if model == CPU_SMOKE else model,
                       help=f"preset or checkpoint dir (default: {shown})")
    if device:
        p.add_argument("--device", choices=None if device is True else list(device),
                       default="cuda" if torch.cuda.is_available() else "cpu", help="default: cuda where available")
    if page_size is not None:
        p.add_argument("--page-size", type=int, default=page_size,
                       help="tokens per page" + (" (default: the engine's)" if page_size == 0 else ""))
    if seed is not None:
        p.add_argument("--seed", type=int, default=seed)
    if output:
        p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        p.add_argument("--out", default=None, help="write the result as JSON to this file")


def parse_common_args(p, argv=None) -> argparse.Namespace:
    """p.parse_args(argv), then --model CPU_SMOKE's default for the device: qwen3-8b on CUDA, tiny on the CPU."""
    args = p.parse_args(argv)
    args.model = args.model or ("qwen3-8b" if args.device == "cuda" else "tiny")
    return args


def add_engine_mode_args(p) -> None:
    """Flags both hicache benchmarks take: engine mode and the event log."""
    p.add_argument("--disable-cuda-graphs", action="store_true", help="eager small forwards (CUDA)")
    p.add_argument("--enable-cuda-graphs", action="store_true", help=argparse.SUPPRESS)  # the default; kept
    p.add_argument("--disable-restore-overlap", action="store_true",
                   help="finish each L2 restore before its tail forward starts")
    p.add_argument("--kernel-restore-max-tokens", type=non_negative_int, default=None,
                   help="layer-ordered restores up to this many tokens by the copy kernel (default: the engine's)")
    p.add_argument("--disable-kernel-calibration", action="store_true",
                   help="keep --kernel-restore-max-tokens as given (not lowered where the kernel times slower)")
    p.add_argument("--disable-whole-first", action="store_true",
                   help="layer-ordered restores move every page in layers (none first, whole)")
    p.add_argument("--disable-outcomes", action="store_true",
                   help="cost policy: price restores by their transfers only (hicache/outcomes.py)")
    p.add_argument("--small-gemm", default=None, choices=["triton", "cublas"],
                   help="projections of forwards of at most 64 rows (default: the engine's)")
    p.add_argument("--gpu-wait", default=None, choices=["spin", "block"],
                   help="how the loop waits for a forward (default: the engine's)")
    p.add_argument("--disable-fp32-lm-head", action="store_true", help="the LM head's bf16 output (vLLM's)")
    p.add_argument("--log-json", default=None)


def hicache_override_args(args) -> dict:
    """with_hicache() changes for --kernel-restore-max-tokens, --disable-kernel-calibration, --disable-whole-first,
    --disable-outcomes (if given)."""
    n = getattr(args, "kernel_restore_max_tokens", None)
    return (({} if n is None else {"kernel_restore_max_tokens": n})
            | ({"kernel_calibration": False} if getattr(args, "disable_kernel_calibration", False) else {})
            | ({"whole_first": False} if getattr(args, "disable_whole_first", False) else {})
            | ({"learn_outcomes": False} if getattr(args, "disable_outcomes", False) else {}))


def engine_mode_args(args) -> dict:
    """EngineConfig fields for --small-gemm, --gpu-wait and --disable-fp32-lm-head (none that was not given)."""
    given = {"small_gemm": getattr(args, "small_gemm", None), "gpu_wait": getattr(args, "gpu_wait", None),
             "fp32_lm_head": False if getattr(args, "disable_fp32_lm_head", False) else None}
    return {k: v for k, v in given.items() if v is not None}


@contextlib.contextmanager
def shared_model():
    """While active, every Engine built in this process with the same (model, device, dtype, seed)
    reuses one loaded model (weights are read-only at inference; each Engine has its own KV pools)."""
    import scheduler.engine as engine_mod

    original = engine_mod.load_model
    loaded: dict = {}

    def load(name, device, dtype, seed):
        key = (name, str(device), str(dtype), seed)
        if key not in loaded:
            loaded[key] = original(name, device, dtype, seed)
        return loaded[key]

    engine_mod.load_model = load
    try:
        yield loaded
    finally:
        engine_mod.load_model = original
        loaded.clear()


def integrity_of(engine) -> str:
    try:
        engine.check_integrity()
        return "passed"
    except Exception as exc:  # report, never hide
        return f"{type(exc).__name__}: {exc}"


async def evict(engine, tiers) -> None:
    """Wait for every pending backup / restore, then empty the given tiers (unlocked pages only;
    nothing is locked once the engine is idle)."""
    from hicache.radix import Tier

    await engine.cache.drain()
    for tier in tiers:
        t = {"l1": Tier.L1, "l2": Tier.L2, "l3": Tier.L3}[tier]
        if t in engine.cache.tree.allocators:
            # a reset, not workload: write admission does not learn from it; under write_back L1's
            # unsaved pages are written back first (what write_through had saved already)
            await engine.cache.flush_async(t)
            await engine.cache.drain()  # (their L3 writes, which hold their L2 pages)


async def run_one(engine, prompt: list[int], max_tokens: int = 1):
    """One greedy request; returns (output ids, seconds submit -> finish, per-tier hit tokens, error)."""
    from scheduler.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    res = (await engine.generate_async([prompt], params))[0]
    return res.output_ids, time.perf_counter() - t0, dict(res.cached_tokens), res.error


async def close_engine(engine) -> None:
    """Shut the engine down (drains transfers, closes the L3 store); call free_memory() after the
    caller dropped its last reference."""
    await engine.shutdown()


def free_memory() -> None:
    """Collect dropped engines (their pools sit in reference cycles) and return cached GPU memory."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_read_gib_s(device, copy_bytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device memory bandwidth from a large copy, read + write bytes counted as one stream (the
    weight-read floor's rate): the best of `repeats` copies on the device clock; 0.0 off CUDA.
    (Timed on the host once after 10 copies it read 10 % low in bench_engine: 3,509 against the
    3,850-3,960 GiB/s this gives in a fresh process; session 20.)"""
    device = torch.device(device)
    if device.type != "cuda":
        return 0.0
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times_ms = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end))
    del src, dst
    return 2 * copy_bytes / (min(times_ms) / 1e3) / (1 << 30)


def forward_read_bytes(model) -> int:
    """Weight bytes one forward reads: every parameter but the input embedding table, of which it
    reads a row a token (kept when tied: the table is then the LM head too)."""
    embed = model.embed_tokens.weight
    tied = model.lm_head is None
    return sum(p.numel() * p.element_size() for p in model.parameters()) - (0 if tied else embed.numel() * embed.element_size())


async def tail_forward_s(engine, prompt: list[int], tail_tokens: int, repeats: int) -> list[float]:
    """Seconds of `repeats` forwards alone (launch to tokens back, no request bookkeeping) over the
    last `tail_tokens` of `prompt`, whose prefix L1 holds: the uncached tail after a restore. The
    rows are the cached prompt's last tokens, rewritten in place (the same K/V at the same slots), so
    run it after any output check."""
    from scheduler.runner import BatchInput

    m = engine.cache.match(prompt)
    cached = m.lengths[0]
    if cached < tail_tokens:
        raise ValueError(f"only {cached} tokens of the prompt are in L1, fewer than the {tail_tokens}-token tail")
    pos = cached - tail_tokens
    binput = BatchInput(list(prompt[pos:cached]), [pos], [tail_tokens], [list(m.pages[0])], [0.0], [1.0], [None],
                        is_decode=False)
    times = []
    for _ in range(repeats + 2):  # two warm-ups: the first replays capture or compile
        sync(str(engine.device))
        t = time.perf_counter()
        await engine.runner.collect(engine.runner.launch(binput))
        times.append(time.perf_counter() - t)
    return times[2:]


# -- same-run physical limits ----------------------------------------------------------------------
def copy_limits(num_bytes: int, device: str, repeats: int = 5) -> dict:
    """Median GiB/s of one plain `copy_` of `num_bytes`: pinned host <-> device on CUDA (H2D, D2H);
    on the CPU a plain memory copy (what the CPU "transfer" does), reported for both directions."""
    num_bytes = max(1, int(num_bytes))
    if device != "cuda":
        a = torch.ones(num_bytes, dtype=torch.uint8)
        b = torch.empty_like(a)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            b.copy_(a)
            if i:
                times.append(time.perf_counter() - t0)
        g = num_bytes / GIB / median(times)
        return {"h2d_gib_s": g, "d2h_gib_s": g, "copy_kind": "cpu memcpy", "bytes": num_bytes}
    host = torch.ones(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    out = {"copy_kind": "pinned copy_", "bytes": num_bytes}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for i in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i:
                times.append(start.elapsed_time(end) / 1e3)
        out[f"{name}_gib_s"] = num_bytes / GIB / median(times)
    del host, dev
    torch.cuda.empty_cache()
    return out


def drop_page_cache_fd(fd: int) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache (sysfs), or None where it is not listed."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(path).read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes) if sizes else None


def file_read_limit(directory: str, num_bytes: int, threads: int, cold: bool, pinned: bool,
                    repeats: int = 3) -> dict:
    """Median GiB/s of a raw sequential read of `num_bytes` with `threads` parallel `os.preadv` into one
    (pinned on CUDA) buffer, from a file written next to the L3 file and dropped from the page cache
    before each read when `cold`. The probe file is removed afterwards."""
    num_bytes = max(4096, int(num_bytes))
    buf = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)
    block = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for o in range(0, num_bytes, block.numel()):  # incompressible content, cheap to make
        buf[o:o + block.numel()] = block[: num_bytes - o]
    view = memoryview(buf.numpy()).cast("B")
    fd, path = tempfile.mkstemp(prefix="read-probe-", suffix=".bin", dir=directory)
    dropped = None
    try:
        done = 0
        while done < num_bytes:
            done += os.pwrite(fd, view[done:], done)
        os.fsync(fd)
        chunk = -(-num_bytes // threads)
        chunk += (-chunk) % 4096
        spans = [(o, min(o + chunk, num_bytes)) for o in range(0, num_bytes, chunk)]

        def read_span(span):
            lo, hi = span
            pos = lo
            while pos < hi:
                n = os.preadv(fd, [view[pos:hi]], pos)
                if n <= 0:
                    raise OSError(f"short read at {pos}")
                pos += n

        times, llc_cold = [], []
        llc = None if cold else last_level_cache_bytes()
        with cf.ThreadPoolExecutor(max_workers=threads) as pool:
            if not cold:
                list(pool.map(read_span, spans))  # warm the page cache
            for _ in range(repeats):
                if cold:
                    ok = drop_page_cache_fd(fd)
                    dropped = ok if dropped is None else (dropped and ok)
                t0 = time.perf_counter()
                list(pool.map(read_span, spans))
                times.append(time.perf_counter() - t0)
            if llc:  # the same warm read with the file's pages and the buffer out of the CPU's caches
                flush = np.empty(2 * llc, dtype=np.uint8)
                for i in range(repeats):
                    flush.fill(i + 1)
                    t0 = time.perf_counter()
                    list(pool.map(read_span, spans))
                    llc_cold.append(time.perf_counter() - t0)
                del flush
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return {"file_read_gib_s": num_bytes / GIB / median(times), "threads": threads,
            # a warm read back to back can be served by the CPU's last-level cache (300 MiB on the
            # H200's host: 50 MiB read at ~33 GiB/s, ~19 after the cache was flushed; session 14)
            "file_read_llc_cold_gib_s": num_bytes / GIB / median(llc_cold) if llc_cold else None,
            "cache": "cold" if cold else "warm", "page_cache_dropped": dropped, "bytes": num_bytes}


def write_result(out: dict, path: str | None, to_stdout: bool) -> None:
    """A benchmark's result as indented JSON: into `path` (--out) and/or on stdout (--json)."""
    text = json.dumps(out, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text)
    if to_stdout:
        print(text)

"""Where an L2-hit request's host time goes, stage by stage: the stress workload
(scripts/bench_hicache_stress.py, tiers none and l2) with wall-clock timers around the engine's
stages (admission, restore enqueue, graph staging and launch, waiting for the device, the
bookkeeping after a step, finishing). Plain timers, not cProfile: they cost ~1 us per call, so the
figures are what the request really spends. Prints per-request milliseconds and per-call
microseconds of each stage, measured over the l2 tier only.

    python3 scripts/profile_stages.py --model qwen3-8b            # on the GPU
    python3 scripts/profile_stages.py --model tiny --device cpu --requests 24
    python3 scripts/profile_stages.py --model qwen3-8b --fine        # + the calls inside the stages
    python3 scripts/profile_stages.py --model qwen3-8b --cprofile 25 # + cProfile's top functions
    python3 scripts/profile_stages.py --model qwen3-8b --spans       # device clock, no timers
    python3 scripts/profile_stages.py --model qwen3-8b --spans --ab pdl  # variants in turn, one process
--spans: instead of the timers, CUDA events recorded on the compute stream at the request's
arrival, the forward's launch, the graph replay, and the request's finish, plus one behind the
forward: a request's span on one clock, split into host time before the launch, graph staging,
the forward on the device (from the replay call to its last kernel) and host time after it. The
events are recorded while the stream is idle except the one behind the forward, so their times
are the host's (within a few us); each costs ~2 us.
Other arguments are passed to bench_hicache_stress.py. Stages nest (a restore's enqueue is inside
admission), so the rows do not add up.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import inspect
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_hicache_stress as stress  # noqa: E402
from bench_cli import human_output, positive_int  # noqa: E402
import torch  # noqa: E402

# (module, class, method): the stages of a request, in order
STAGES = [
    ("scheduler.engine", "Engine", "add_request"),
    ("scheduler.admission", "Admission", "prefill_batch"),
    ("scheduler.restoring", "Restoring", "_try_restore"),
    ("hicache.transfer", "TransferEngine", "h2d_layerwise"),
    ("scheduler.runner", "ModelRunner", "launch"),
    ("scheduler.cuda_graphs", "DecodeGraphs", "run"),
    ("scheduler.runner", "ModelRunner", "collect"),
    ("scheduler.restoring", "Restoring", "after_overlapped_forward"),
    ("scheduler.engine", "Engine", "_after_batch"),
    ("scheduler.admission", "Admission", "after_step"),
    ("scheduler.engine", "Engine", "finish"),
]
# --fine: the calls inside those stages (a class of None: a function looked up in that module)
FINE_STAGES = [
    ("hicache.manager", "CacheManager", "decide"),
    ("hicache.restores", "Restores", "start_restore"),
    ("hicache.transfer", "TransferEngine", "_copy_kernel"),
    ("kernels.host_copy", "HostCopy", "h2d_layers"),
    ("scheduler.restoring", "Restoring", "_admit_overlapped"),
    ("scheduler.cuda_graphs", None, "fill_staging"),
    ("torch.cuda.graphs", "CUDAGraph", "replay"),
    ("scheduler.runner", None, "sample"),
    ("kernels.layer_flags", "LayerFlags", "stage_status"),
    ("scheduler.admission", "Admission", "_publish"),
    ("scheduler.admission", "Admission", "release"),
    ("scheduler.engine", "Engine", "log_event"),
]

totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # label -> [calls, ns]
measuring = False


def timed(label: str, fn):
    def account(t0: int) -> None:
        if measuring:
            totals[label][0] += 1
            totals[label][1] += time.perf_counter_ns() - t0

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return await fn(*args, **kwargs)
            finally:
                account(t0)
    else:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                account(t0)
    return wrapper


def install(stages=STAGES):
    """Wrap every stage; returns the function that puts the originals back."""
    import importlib

    originals = []
    for module_name, cls_name, name in stages:
        module = importlib.import_module(module_name)
        owner = module if cls_name is None else getattr(module, cls_name)
        # (inherited from a mixin: the original is the class's own attribute only where it has one)
        originals.append((owner, name, owner.__dict__.get(name, getattr(owner, name))))
        setattr(owner, name, timed(f"{cls_name or module_name.split('.')[-1]}.{name}", getattr(owner, name)))

    def restore() -> None:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return restore


SPAN_MARKS = ("arrive", "launch", "replay", "forward_end", "finish")
spans: dict[str, list[dict]] = collections.defaultdict(list)  # tier -> one dict of events per request


def install_spans(tier_of):
    """Hooks that record SPAN_MARKS events into the current request's dict (requests run one at a
    time); returns the function that puts the originals back."""
    import torch

    from scheduler.engine import Engine
    from scheduler.runner import ModelRunner
    current: dict = {}

    def mark(name: str) -> None:
        if name not in current:
            current[name] = torch.cuda.Event(enable_timing=True)
            current[name].record()

    add_request, launch, finish, replay = Engine.add_request, ModelRunner.launch, Engine.finish, torch.cuda.CUDAGraph.replay

    def add_request_(self, *a, **k):
        current.clear()
        mark("arrive")
        return add_request(self, *a, **k)

    def launch_(self, *a, **k):
        mark("launch")
        out = launch(self, *a, **k)
        mark("forward_end")
        return out

    def replay_(self, *a, **k):
        mark("replay")
        return replay(self, *a, **k)

    def finish_(self, *a, **k):
        out = finish(self, *a, **k)
        mark("finish")
        spans[tier_of()].append(dict(current))
        return out

    Engine.add_request, ModelRunner.launch, Engine.finish = add_request_, launch_, finish_
    torch.cuda.CUDAGraph.replay = replay_

    def restore() -> None:
        Engine.add_request, ModelRunner.launch, Engine.finish = add_request, launch, finish
        torch.cuda.CUDAGraph.replay = replay
    return restore


def print_spans(tier: str, first: int, last: int) -> None:
    """Median ms of each segment over requests [first, last) of the tier (its measured hits)."""
    import statistics

    import torch

    torch.cuda.synchronize()
    rows = spans[tier][first:last]
    for r in rows:
        r.setdefault("replay", r["launch"])  # an eager forward (no graph): staging counts as the forward
    segments = [("arrive", "launch", "host: admission, restore enqueue"), ("launch", "replay", "host: graph staging"),
                ("replay", "forward_end", "device: the forward"), ("forward_end", "finish", "host: completion, bookkeeping"),
                ("arrive", "finish", "request")]
    print(f"{tier} tier: {len(rows)} requests, median ms on the device clock")
    for a, b, what in segments:
        print(f"  {a:>11s} -> {b:<11s} {statistics.median(r[a].elapsed_time(r[b]) for r in rows):7.3f}  {what}")
    gaps = [x["finish"].elapsed_time(y["arrive"]) for x, y in zip(rows, rows[1:])]
    if gaps:
        print(f"  {'finish':>11s} -> {'arrive':<11s} {statistics.median(gaps):7.3f}  host: the client's next request")


def own_parser() -> argparse.ArgumentParser:
    """The flags main() takes itself, parsed by hand there (the rest go to bench_hicache_stress.py):
    for --help only (regression: --help showed only bench_hicache_stress.py's options and description)."""
    p = argparse.ArgumentParser(prog="profile_stages.py", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [-h] [--fine] [--cprofile N] [--spans [--ab NAME]] "
                                      "[bench_hicache_stress.py options]",
                                epilog="bench_hicache_stress.py's options, passed on to it, follow.")
    p.add_argument("--fine", action="store_true", help="also time the calls inside the stages")
    p.add_argument("--cprofile", metavar="N", type=positive_int,
                   help="also print cProfile's top N functions (l2 tier)")
    p.add_argument("--spans", action="store_true", help="stamp a request's span on the device clock, no timers")
    p.add_argument("--ab", metavar="NAME", help="with --spans: variants in turn in one process (split-k, pdl)")
    return p


def print_help() -> None:
    own_parser().print_help()
    print()
    prog, sys.argv[0] = sys.argv[0], "bench_hicache_stress.py"  # (its parser's prog)
    try:
        stress.parse_args(["--help"])
    except SystemExit:
        pass
    finally:
        sys.argv[0] = prog


def main(argv=None) -> int:
    totals.clear()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return 0
    if "--spans" in argv:
        return main_spans([a for a in argv if a != "--spans"])
    own, argv = own_parser().parse_known_args(argv)  # (regression: --cprofile parsed by hand, a traceback)
    if own.ab is not None:
        own_parser().error("--ab is --spans's")
    check_tiers(argv)
    fine, top = own.fine, own.cprofile or 0
    as_json = "--json" in argv  # (stdout carries bench_hicache_stress.py's JSON alone: the tables to stderr)
    restore = install(STAGES + FINE_STAGES if fine else STAGES)
    throughput, run_batch = stress.throughput, stress.run_batch

    async def measured(args, tier, prompts, *rest, **kwargs):
        l2 = tier == "l2"
        profiler = cProfile.Profile() if l2 and top else None
        if profiler is not None:
            profiler.enable()

        async def timed_batch(eng, batch, *a, **k):
            # the timers run over the measured requests alone, the count the table divides by (regression: the
            # warm-up's requests on other prefixes were timed too)
            global measuring
            measuring = l2 and batch is prompts
            try:
                return await run_batch(eng, batch, *a, **k)
            finally:
                measuring = False
        stress.run_batch = timed_batch
        try:
            result = await throughput(args, tier, prompts, *rest, **kwargs)
        finally:
            stress.run_batch = run_batch
        with human_output(as_json):
            report(profiler, result, l2)
        return result

    def report(profiler, result, l2: bool) -> None:
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(top)
        if l2:
            n = result["requests"]
            print(f"l2 tier: {n} requests, p50 {result['latency_ms']['p50']:.2f} ms, {result['req_s']:.1f} req/s")
            print(f"  {'stage':40s} {'calls':>6s} {'ms/request':>11s} {'us/call':>9s}")
            for label, (calls, ns) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
                print(f"  {label:40s} {calls:6d} {ns / 1e6 / n:11.3f} {ns / 1e3 / max(calls, 1):9.1f}")

    stress.throughput = measured
    try:
        return stress.main(["--tiers", "none,l2"] + argv)
    finally:
        stress.throughput = throughput
        restore()


def check_tiers(argv) -> None:
    """This script runs the tiers itself (regression: --tier none or --tiers l3 printed no stage table, rc 0)."""
    given = [a for a in argv if a.split("=")[0] in ("--tier", "--tiers")]
    if given:
        own_parser().error(f"{given[0].split('=')[0]}: profile_stages.py runs its tiers itself (none, then l2)")


def ab_variants(name: str) -> list[tuple[str, object]]:
    """--ab NAME: (label, set-up) pairs run in turn, twice, as separate l2 engines (an engine captures
    its graphs when built, so each set-up runs before its engine)."""
    from kernels import pdl, skinny_gemm

    split_k_for, on_by_default = skinny_gemm.split_k_for, pdl._enabled

    def setting(split=True, on=on_by_default):
        def apply():
            skinny_gemm.split_k_for = split_k_for if split else (lambda n, k: 1)
            pdl.set_enabled(on)
        return apply

    variants = {
        "split-k": [("split", setting()), ("whole", setting(split=False))],  # kernels/skinny_gemm.py
        "pdl": [("pdl", setting(on=True)), ("no pdl", setting(on=False))],  # kernels/pdl.py
    }
    if name not in variants:
        raise SystemExit(f"--ab takes one of {', '.join(variants)}, got {name!r}")
    return variants[name] + [("defaults", setting())]  # the last restores the defaults


def main_spans(argv) -> int:
    """--ab NAME: the l2 tier twice per variant of ab_variants(NAME), in turn, after one none tier."""
    device = argv[argv.index("--device") + 1] if "--device" in argv[:-1] else "cuda"
    if not (device.startswith("cuda") and torch.cuda.is_available()):  # (regression: a traceback after the none tier)
        print("profile_stages.py --spans needs CUDA (its spans are CUDA events on the device clock)", file=sys.stderr)
        return 2
    check_tiers(argv)
    spans.clear()
    tier = {"name": "none"}
    restore = install_spans(lambda: tier["name"])
    throughput = stress.throughput
    variants, reset = [], None
    if "--ab" in argv:
        i = argv.index("--ab")
        if i + 1 >= len(argv):
            raise SystemExit("--ab needs a name")
        *variants, (_, reset) = ab_variants(argv[i + 1])
        del argv[i:i + 2]
    runs = {"l2": 0}

    async def measured(args, name, *rest, **kwargs):
        label = name
        if variants and name == "l2":
            label, apply = variants[runs["l2"] % len(variants)]
            runs["l2"] += 1
            apply()
            label = f"l2 {label}"
        tier["name"] = label
        first = len(spans[label])
        result = await throughput(args, name, *rest, **kwargs)
        # the measured requests are the tier's first `requests` after its warm-up; the first round
        # of prefixes misses every tier
        start = first + args.warmup + args.num_prefixes
        with human_output("--json" in argv):
            print_spans(label, start, first + args.warmup + args.requests)
        return result

    stress.throughput = measured
    try:
        return stress.main(["--tiers", ",".join(["none"] + ["l2"] * (2 * len(variants) or 1))] + argv)
    finally:
        stress.throughput = throughput
        if reset is not None:
            reset()
        restore()


if __name__ == "__main__":
    sys.exit(main())

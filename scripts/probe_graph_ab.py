"""Variants of one small-forward graph, captured side by side in one process and timed in turn on
the device clock. (GPU only.)

A forward's kernel choices (PDL per kernel family, the embedding's own kernel) change its device
time by 0.01-0.2 ms, less than the spread between processes (a new process on the same lease moves
an engine's forward by ~0.1 ms). So each variant's graph is captured in the same engine, over the
same KV, and the variants are replayed in turn, each launch queued behind a ~1.5 ms sleep kernel so
the host's staging is off the clock: what is timed is the launch's device work (the staging copy,
the graph, sampling and the token's copy back; only the graph differs between variants). Session
25 found this way that a multi-row tail's attention ran faster without PDL, and session 28 why: with
PDL some SMs took two of its split programs (kernels/pdl.py spread; docs/benchmarks.md).

    python3 scripts/probe_graph_ab.py                                  # every variant, 350 / 3,500 keys
    python3 scripts/probe_graph_ab.py --variants engine,embed_kernel --contexts 350,1000,3500,8000 --rows 16

Variants ("engine" is always timed first as the reference):
  engine           the engine's own captured graph
  pdl_off_attn     the paged attention's kernels launched without PDL
  pdl_off_tail_attn  a multi-row tail's attention launched the ordinary way (sessions 25-27)
  unspread         one-wave split kernels under PDL not spread one program an SM (kernels/pdl.py
                   spread; with the tail's attention under PDL, session 25's choice before it)
  pdl_off_skinny   the skinny projections without PDL
  pdl_off_norms    the norms, q/k-norm + RoPE and SiLU kernels without PDL
  pdl_off_all      every Triton kernel without PDL
  embed_kernel     the embedding by its own kernel before layer 0's norm (before session 25)
  skinny_first_row (timing only: wrong tokens) the skinny projections load and compute their
                   first input row only, as for one-row decode: what the other rows' input tiles,
                   re-read by every program, cost a 16-row forward
Each row prints the median device ms per round (rounds alternate the variants) and whether the
sampled token equals the engine graph's. --kernels then profiles a few launches of every graph
(after all timings: torch.profiler's hooks slow a process's later CUDA calls) and prints each
one's device time by kernel family (scripts/trace_kernels.py), the skinny projections by their
place in a layer; under PDL a kernel's span includes its programs' wait for the one before.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import decode_attention, fused_ops, pdl, skinny_gemm  # noqa: E402
from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402
from scheduler.runner import BatchInput  # noqa: E402
import trace_kernels  # noqa: E402  (this directory, on sys.path above)

SLEEP_CYCLES = 3_000_000  # ~1.5 ms on the H200: the launch's host work lands behind it


class _Pdl:
    """Stands in for kernels/pdl.py in one kernel module while a variant is captured."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def launch_kwargs(self, device: torch.device) -> dict:
        return {"PDL": True, "launch_pdl": True} if self.on and pdl.enabled(device) else {"PDL": False}


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _embed_kernel():
    """Layer 0's norm fed by F.embedding (its own kernel) instead of gathering the rows itself."""
    real = fused_ops.add_rms_norm_triton

    def norm(x, residual, weight, eps, rows=None):
        if residual is None and rows is not None and x.dim() == 2 and x.shape[0] > rows.shape[0]:
            return real(F.embedding(rows, x), None, weight, eps)
        return real(x, residual, weight, eps, rows=rows)
    with _patched(fused_ops, "add_rms_norm_triton", norm):
        yield


@contextlib.contextmanager
def _unspread():
    """Split kernels launched with PDL not spread: the kernels spread already ask for their compiled
    shared memory again while the variant is captured, and are spread again after (graphs keep what
    they captured)."""
    spread = list(pdl._spread.items())
    for kernel, compiled_bytes in spread:
        pdl.ask_shared(kernel, compiled_bytes)
        del pdl._spread[kernel]
    try:
        with _patched(decode_attention, "SPREAD_SPLITS", False):
            yield
    finally:
        for kernel, _ in spread:
            pdl.spread(kernel, torch.device("cuda"))


class _FirstRowOnly:
    """Stands in for skinny_gemm._skinny_kernel: launches it with M = 1 (rows past the first are
    masked off: their outputs are never written)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda x, w, y, m, n, k, **kw: launch(x, w, y, 1, n, k, **kw)


VARIANTS = {
    "pdl_off_attn": lambda: _patched(decode_attention, "pdl", _Pdl(False)),
    "pdl_off_tail_attn": lambda: _patched(decode_attention, "TAIL_PDL", False),
    "unspread": _unspread,
    "pdl_off_skinny": lambda: _patched(skinny_gemm, "pdl", _Pdl(False)),
    "pdl_off_norms": lambda: _patched(fused_ops, "pdl", _Pdl(False)),
    "pdl_off_all": lambda: _patched(pdl, "_enabled", False),
    "embed_kernel": _embed_kernel,
    "skinny_first_row": lambda: _patched(skinny_gemm, "_skinny_kernel", _FirstRowOnly(skinny_gemm._skinny_kernel)),
}


def capture(graphs, shape: tuple[int, int], variant: str):
    """The graph of `shape` captured under `variant`'s patches -> (graph, logits), as
    DecodeGraphs._capture does it (two warm-ups, then the capture, on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with VARIANTS[variant](), torch.cuda.stream(stream), torch.inference_mode():
        ids = graphs.rows[0, :shape[0] * shape[1]]
        for _ in range(2):
            graphs.model(ids, graphs._batch(*shape), graphs.kv_pool)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            logits = graphs.model(ids, graphs._batch(*shape), graphs.kv_pool)
    torch.cuda.current_stream().wait_stream(stream)
    return graph, logits


async def run(args) -> None:
    engine = Engine(EngineConfig(model=args.model, device="cuda", page_size=16, max_total_tokens=args.pool_tokens,
                                 max_prefill_tokens=16384, cuda_graphs=True, max_running_requests=64))
    await engine.start()
    graphs = engine.runner.graphs
    shapes = [(1, r) for r in args.rows]
    variants = {(s, "engine"): (graphs.graphs[s], graphs.logits[s]) for s in shapes}
    for s in shapes:
        for v in args.variants:
            variants[(s, v)] = capture(graphs, s, v)
    rng = random.Random(0)
    all_inputs = {}
    print(f"{'context':>7} {'rows':>4} {'variant':16s} device ms per round   same token")
    for ctx in args.contexts:
        cached = [rng.randrange(1, engine.vocab_size) for _ in range(ctx)]
        async for ev in engine.submit(cached + [7], SamplingParams(max_tokens=1, ignore_eos=True)):
            pass
        m = engine.cache.match(cached)
        pages, length = list(m.pages[0]), m.lengths[0]
        inputs = {}
        for s in shapes:
            n = min(s[1], length)  # the tail a restore of this prompt leaves, or one token
            inputs[s] = BatchInput(list(cached[length - n:length]), [length - n], [n], [pages], [0.0], [1.0], [None],
                                   is_decode=False)
        all_inputs[ctx] = inputs
        times, tokens = {}, {}
        for _ in range(args.rounds):
            for (s, v), (graph, logits) in variants.items():
                graphs.graphs[s], graphs.logits[s] = graph, logits
                for _ in range(2):
                    tokens[(s, v)] = await engine.runner.collect(engine.runner.launch(inputs[s]))
                device_ms = []
                for _ in range(args.repeats):
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda._sleep(SLEEP_CYCLES)
                    start.record()
                    engine.runner.launch(inputs[s])
                    end.record()
                    end.synchronize()
                    device_ms.append(start.elapsed_time(end))
                times.setdefault((s, v), []).append(statistics.median(device_ms))
        for s in shapes:
            graphs.graphs[s], graphs.logits[s] = variants[(s, "engine")]
        for (s, v), t in times.items():
            same = "yes" if tokens[(s, v)] == tokens[(s, "engine")] else "NO"
            print(f"{ctx:7d} {s[1]:4d} {v:16s} {' '.join(f'{x:.3f}' for x in t):22s} {same}", flush=True)
    if args.kernels:
        for ctx, inputs in all_inputs.items():
            await profile_kernels(engine, graphs, variants, inputs, ctx, args.kernels)
    await engine.shutdown()


async def profile_kernels(engine, graphs, variants, inputs, ctx: int, launches: int) -> None:
    """Device us a forward by kernel family for every (shape, variant) graph: `launches` launches
    under torch.profiler, each waited for, so each forward is one run of kernels in the trace."""
    from torch.profiler import ProfilerActivity, profile

    columns = {}
    for (s, v), (graph, logits) in variants.items():
        graphs.graphs[s], graphs.logits[s] = graph, logits
        await engine.runner.collect(engine.runner.launch(inputs[s]))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(launches):
                await engine.runner.collect(engine.runner.launch(inputs[s]))
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            runs = trace_kernels.forwards(trace_kernels.load(f.name), gap_us=50.0, min_kernels=100)
        rows = [trace_kernels.summarize(r, [], split_skinny=True) for r in runs]
        fams = {f for r in rows for f in r["by_family_us"]} | {"idle", "span"}
        columns[f"{s[1]}r {v}"] = {f: statistics.median(
            r["span_us"] if f == "span" else r["idle_us"] if f == "idle" else r["by_family_us"].get(f, 0.0)
            for r in rows) for f in fams} if rows else {}
    for s in {s for s, _ in variants}:
        graphs.graphs[s], graphs.logits[s] = variants[(s, "engine")]
    names = sorted({f for c in columns.values() for f in c}, key=lambda f: (f != "span", f))
    print(f"\ndevice us a forward by kernel family at {ctx} cached keys (median of {launches} launches, profiled)")
    print(f"{'family':24s} " + " ".join(f"{c[:22]:>22s}" for c in columns))
    for f in names:
        print(f"{f[:24]:24s} " + " ".join(f"{c.get(f, 0.0):22.1f}" for c in columns.values()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--contexts", default="350,3500", help="cached tokens before the forward's rows")
    ap.add_argument("--rows", default="16,1", help="graph rows per sequence: 16 (a restore's tail), 1 (decode)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=12, help="timed launches per variant and round")
    ap.add_argument("--pool-tokens", type=int, default=200_000)
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="after the timings, profile N launches of every graph: device us by kernel family")
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v and v != "engine"]
    if set(args.variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(set(args.variants) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.rows = [int(r) for r in args.rows.split(",")]
    if any(r not in (1, 16) for r in args.rows):
        ap.error("--rows takes 1 and/or 16 (the captured one-sequence shapes)")
    if not torch.cuda.is_available():
        ap.error("this probe times CUDA graphs: it needs a GPU")
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Replays a Mooncake request trace against the in-process engine and reports hit tokens per tier,
recomputed tokens, TTFT, throughput, bytes moved per direction and the cache's integrity.

    python scripts/replay_trace.py                      # bundled sample, CPU, tiny model, 3 tiers
    python scripts/replay_trace.py --trace T.jsonl --device cuda --model qwen3-8b --num-pages 4096
    python scripts/replay_trace.py --simulate --trace scheduler/sample_trace.jsonl --model qwen3-8b --time-scale 0 \
        --l1-tokens 200000 --l3-gib 2000

Every engine flag (scheduler.config.add_engine_args) is accepted. Without --trace the bundled sample
(scheduler/sample_trace.jsonl) is replayed with small-run defaults: 16 tokens per hash id, the first 200
requests, outputs clipped to 32 tokens, as fast as possible, one request at a time, and pools small
enough (L1 4096 tokens, L2 24576, L3 65536) that the working set overflows L1 and L2.
Capacity flags in tokens or GiB map onto --num-pages / --hicache-size-gb / --hicache-storage-size-gb.
`--simulate` runs the same scheduler, tree, allocators and cost model with no model and no bytes.
With --concurrency 1 every request and every cache operation it caused end before the next request
starts, so a run is deterministic and a simulated run's hits equal a real run's (with a forced policy
and the same KV dtype: a simulation with `--dtype auto` sizes bf16 KV, a GPU deployment's, where a
real CPU run has float32, so capacities in GiB hold half the pages there; give them in tokens, or
give --dtype).
Exit status: 2 for bad input (an option out of range, a trace or path that cannot be used, an engine
that cannot start), 1 when no request completed, the engine crashed, the cache failed its integrity
check or --compare-no-cache found other outputs, 143 when SIGTERM ended the run and 130 when Ctrl-C did (its engine
shut down first, a kept L3's index saved; no summary). Prompt tokens, hits and recomputed tokens are those of
completed requests.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hicache.redis_limits import redact_url
from scheduler import replay_args, replay_memory, sigterm
from scheduler.config import EngineConfig
from scheduler.presets import model_config_of
from scheduler.replay_args import (REPLAY_OPTIONS, check_replay_args, check_writable, config_from_replay_args,
                                   fill_defaults, shown)
from scheduler.replay_memory import flag_name as _flag
from scheduler.trace import (MAX_PROBLEMS_SHOWN, SynthPrompt, TokenSynth, TraceError, TraceProblem, TraceRecord,
                             load_trace, scale_record)

DIRECTIONS = ("d2h", "h2d", "h2s", "s2h")
TIERS = ("l1", "l2", "l3")
INTERRUPTED_STATUS = 128 + signal.SIGINT  # (the shell's status of a process Ctrl-C killed)
SAVE_GRACE_S = 60.0  # the end's shutdown with --hicache-storage-persist: at most this long to save L1's pages


class EngineStartError(Exception):
    """The engine could not be built from this configuration (a path it cannot open, a transfer
    backend this machine cannot run): a user error, reported in one line."""


@dataclass(frozen=True)
class ReplayItem:
    index: int  # position in the replay (request order)
    line_no: int  # line in the trace file
    arrival_s: float  # seconds after the first request, before --time-scale
    source: list[int] | SynthPrompt  # the prompt, or what synthesizes it
    output_tokens: int

    @property
    def prompt(self) -> list[int]:
        return self.source if isinstance(self.source, list) else self.source.tokens()

    @property
    def prompt_tokens(self) -> int:
        return len(self.source)


@dataclass
class Outcome:
    item: ReplayItem
    output_ids: list[int]
    error: str | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None  # submission to first token
    latency_s: float | None = None  # submission to its last event (None: refused at submission)
    hit_tokens: dict[str, int] | None = None  # per tier, as counted in the engine's metrics
    recomputed_tokens: int = 0
    preemptions: int = 0  # (--decode-reserve-ratio below 1)


def build_parser():
    """The replay's command line (scheduler/replay_args.py), described by this module's docstring."""
    return replay_args.build_parser(__doc__)


# -- trace -> requests ----------------------------------------------------------------------------
def build_items(records: list[TraceRecord], vocab_size: int, block_tokens: int, *, seed: int = 0,
                max_input_tokens: int | None = None, max_output_tokens: int | None = None) -> list[ReplayItem]:
    """Scales each record to `block_tokens` per hash id; its prompt is synthesized when it is read
    (`ReplayItem.prompt`, once per submission). Arrivals are relative to the earliest record, and
    requests are ordered by arrival (stable)."""
    synth = TokenSynth(vocab_size, block_tokens, seed)
    t0_ms = min((r.timestamp_ms for r in records), default=0.0)
    ordered = sorted(records, key=lambda r: r.timestamp_ms)
    items = []
    for i, rec in enumerate(ordered):
        rec = scale_record(rec, block_tokens)
        out = rec.output_tokens if max_output_tokens is None else max(1, min(rec.output_tokens, max_output_tokens))
        items.append(ReplayItem(i, rec.line_no, (rec.timestamp_ms - t0_ms) / 1000.0,
                                SynthPrompt(synth, rec, max_input_tokens), out))
    return items


# -- running --------------------------------------------------------------------------------------
async def _one(engine, item: ReplayItem, rid_prefix: str) -> Outcome:
    from scheduler.request import SamplingParams

    params = SamplingParams(max_tokens=item.output_tokens, temperature=0.0, ignore_eos=True)
    out = Outcome(item, [])
    start = time.perf_counter()
    req = None
    try:
        # Engine.submit's loop, keeping the request to read its hits and recomputed tokens at the end
        # (only those: its prompt goes with it)
        req = engine.add_request(item.prompt, params, rid=f"{rid_prefix}{item.index}-line{item.line_no}")
        while True:
            ev = await req.queue.get()
            if ev.token_id is not None:
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - start
                out.output_ids.append(ev.token_id)
            if ev.finished:
                out.finish_reason, out.error = ev.finish_reason, ev.error
                break
    except Exception as exc:  # RequestError (bad request) or anything else: this request failed
        out.error = str(exc) or repr(exc)
    finally:
        if req is not None:
            if not req.state.done:  # (cancelled: an engine crash)
                await engine.abort(req.rid)
            out.hit_tokens, out.recomputed_tokens = dict(req.served_hit_tokens), req.recomputed_tokens
            out.preemptions = req.preemptions
            out.latency_s = time.perf_counter() - start
    if out.error is None and out.finish_reason not in ("length", "stop"):
        out.error = f"finished with reason {out.finish_reason!r}"
    return out


async def _dispatch(engine, items: list[ReplayItem], time_scale: float, concurrency: int, rid_prefix: str,
                    outcomes: list[Outcome | None], on_done) -> None:
    sem = asyncio.Semaphore(concurrency)
    tasks: list[asyncio.Task] = []
    t0 = time.perf_counter()

    async def run(item: ReplayItem) -> None:
        try:
            outcomes[item.index] = await _one(engine, item, rid_prefix)
            on_done(outcomes[item.index])
        finally:
            sem.release()

    for item in items:
        if time_scale > 0:
            delay = t0 + item.arrival_s * time_scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        await sem.acquire()
        if concurrency == 1:  # deterministic: the request and every operation it caused end first
            await run(item)
            await engine.cache.drain()
        else:
            tasks.append(asyncio.get_running_loop().create_task(run(item)))
    await asyncio.gather(*tasks)
    await engine.cache.drain()


async def replay_async(config: EngineConfig, items: list[ReplayItem], *, time_scale: float = 0.0,
                       concurrency: int = 1, progress: bool = False, rid_prefix: str = "r",
                       announce: str | None = None) -> dict:
    """Replays `items` on a fresh engine; returns the run's figures (see `summarize`). announce: a
    prefix to print on stderr, once the engine is built, before what it runs (model, device, tiers)."""
    if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:  # (as --concurrency:
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")  # 0 hung its driver for good)
    from scheduler.engine import Engine
    from scheduler.memory_plan import pools_line

    try:
        engine = Engine(config)
    except (OSError, RuntimeError) as exc:
        raise EngineStartError(f"cannot start the engine: {exc}") from exc
    outcomes: list[Outcome | None] = [None] * len(items)
    bar = None
    crash = None
    try:  # (from here on the engine is shut down whatever raises: regression, the start line's print raised before)
        if announce is not None:  # (regression: the replay never said what it ran; the server's start line)
            print(f"{announce}{pools_line(engine.status())}", file=sys.stderr, flush=True)
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(items), unit="req", desc="replay", leave=False)
        on_done = (lambda o: bar.update(1)) if bar is not None else (lambda o: None)
        start = time.perf_counter()
        await engine.start()
        driver = asyncio.get_running_loop().create_task(
            _dispatch(engine, items, time_scale, concurrency, rid_prefix, outcomes, on_done))
        loop_task = getattr(engine, "_loop_task", None)
        watch = {driver} | ({loop_task} if loop_task is not None else set())
        try:
            done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (SIGTERM, a caller's timeout): the driver too (regression: it ran on,
            driver.cancel()  # slept to each later arrival and submitted the rest of the trace to the shut-down engine)
            await asyncio.gather(driver, return_exceptions=True)
            raise
        if driver not in done:  # the engine's loop ended under the replay: nothing will finish now
            exc = loop_task.exception() if not loop_task.cancelled() else None
            crash = f"engine loop stopped: {exc!r}"
            driver.cancel()
            await asyncio.gather(driver, return_exceptions=True)
        else:
            driver.result()
        wall_s = time.perf_counter() - start
        try:
            engine.check_integrity()
            integrity = "passed"
        except Exception as exc:
            integrity = f"{type(exc).__name__}: {exc}"
        metrics = engine.metrics()
        status = engine.status()["engine"]  # (--speculative-config: its counters; preemptions)
    finally:
        if bar is not None:
            bar.close()
        try:  # (a kept L3 file: write_back's unsaved prefixes saved for the next run, as a server's grace does)
            await engine.shutdown(SAVE_GRACE_S if engine.cache.config.storage_persist else 0.0)
        except Exception as exc:  # a crashed loop re-raises here, before the tiers are closed
            crash = crash or f"engine shutdown failed: {exc!r}"
            await engine.cache.close()
            engine.runner.close()
    outcomes = [o if o is not None else Outcome(it, [], error=crash or "not run") for o, it in zip(outcomes, items)]
    return {"outcomes": outcomes, "metrics": metrics, "integrity": integrity, "wall_s": wall_s,
            "engine_crash": crash, "speculative": status.get("speculative"), "preempted": status["preempted"],
            "preempted_recomputed_tokens": status["preempted_recomputed_tokens"]}


def replay(config: EngineConfig, items: list[ReplayItem], **kw) -> dict:
    """replay_async on a uvloop of its own, whose run SIGTERM cancels (its engine shut down first); sigterm.Terminated
    where it did. (Only on that loop: replay_async awaited on a program's own loop replaced the SIGTERM handler that
    program had set on it, and after the run left SIGTERM ignored: regression.)"""
    import uvloop

    async def run() -> dict:
        restore_sigterm = sigterm.cancels(asyncio.current_task())
        try:
            return await replay_async(config, items, **kw)
        finally:
            restore_sigterm()
    return sigterm.run(uvloop.run, run())


# -- reporting ------------------------------------------------------------------------------------
def outputs_digest(outcomes: list[Outcome]) -> str:
    """sha256 over every generated token id in request order (a request's ids, then a separator)."""
    h = hashlib.sha256()
    for o in outcomes:
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in o.output_ids) + b"\xff" * 4)
    return h.hexdigest()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def request_records(outcomes: list[Outcome], timed: bool = True) -> list[dict]:
    """One small record per replayed trace line, in trace order (malformed lines are `problems`, not
    records). Arrivals are before --time-scale; TTFT is null for a request that got no token, the
    latency for one refused at submission, and both for every request of a `--simulate` run (it
    times nothing)."""
    def ms(s: float | None) -> float | None:
        return None if s is None or not timed else s * 1e3
    records = []
    for o in sorted(outcomes, key=lambda o: o.item.line_no):
        hits = o.hit_tokens or {}
        records.append({"line": o.item.line_no, "arrival_ms": o.item.arrival_s * 1e3,
                        "prompt_tokens": o.item.prompt_tokens, "output_tokens": len(o.output_ids),
                        "hit_tokens": {t: int(hits.get(t, 0)) for t in TIERS},
                        "recomputed_tokens": o.recomputed_tokens, "ttft_ms": ms(o.ttft_s),
                        "latency_ms": ms(o.latency_s), "preemptions": o.preemptions,
                        "finish_reason": o.finish_reason, "error": o.error})
    return records


def summarize(run: dict, problems: list[TraceProblem], config: EngineConfig, replay_options: dict) -> dict:
    outcomes, m = run["outcomes"], run["metrics"]
    ok, timed = [o for o in outcomes if o.error is None], not config.simulate  # (a simulation times nothing: no
    ttft_ms = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None and timed]  # TTFT, no rate; regression: host time)
    wall_s = run["wall_s"]
    return {
        "requests": len(outcomes), "completed": len(ok), "failed": len(outcomes) - len(ok),
        # completed requests only, the prompts the hit and recomputed tokens add up to (a request
        # refused at submission, e.g. one longer than L1, is never prefilled)
        "prompt_tokens": sum(o.item.prompt_tokens for o in ok),
        "failed_prompt_tokens": sum(o.item.prompt_tokens for o in outcomes if o.error is not None),
        "output_tokens": sum(len(o.output_ids) for o in outcomes),
        # (the completed requests' own; the engine's totals, in `metrics`, also count the prefills of requests that
        # failed after admission, e.g. when the engine crashed: regression, shown over 100 % of the prompts)
        "hit_tokens": {t: sum(int((o.hit_tokens or {}).get(t, 0)) for o in ok) for t in TIERS},
        "recomputed_tokens": sum(o.recomputed_tokens for o in ok),
        "ttft_ms": {f"p{q}": _percentile(ttft_ms, q / 100) for q in (50, 90, 99)},
        "throughput_req_s": (len(ok) / wall_s if wall_s > 0 else 0.0) if timed else None,
        "wall_s": wall_s,
        "bytes": {d: int(m["directions"][d]["bytes"]) for d in DIRECTIONS},
        "integrity": run["integrity"],
        "outputs_digest": outputs_digest(outcomes),
        "errors": [{"index": o.item.index, "line": o.item.line_no, "error": o.error} for o in outcomes if o.error],
        "problems": [{"line": p.line_no, "reason": p.reason} for p in problems],
        "engine_crash": run["engine_crash"],
        "config": {"engine": _shown_config(config), "replay": replay_options},
        "metrics": m,
        "speculative": run.get("speculative"),  # (None: speculation off)
        # (--decode-reserve-ratio below 1: preemptions, and the tokens their resumptions computed again, apart)
        "preempted": run.get("preempted", 0), "preempted_recomputed_tokens": run.get("preempted_recomputed_tokens", 0),
        # per trace line (`requests` is the count above); a --simulate run times nothing
        "request_records": request_records(outcomes, timed=timed),
    }


def _shown_config(config: EngineConfig) -> dict:
    """The engine's settings as a report shows them: a storage URL's password masked, as in the logs and status
    (regression: --json-out wrote it in clear)."""
    shown = dataclasses.asdict(config)
    if config.hicache.storage_url:
        shown["hicache"]["storage_url"] = redact_url(config.hicache.storage_url)
    return shown


def format_summary(s: dict) -> str:
    def num(x, fmt="{:,}"):
        return "-" if x is None else fmt.format(x)
    hits = s["hit_tokens"]
    prompt = max(1, s["prompt_tokens"])
    failed_prompt = f" (+{s['failed_prompt_tokens']:,} in failed requests)" if s["failed_prompt_tokens"] else ""
    rows = [("requests", f"{s['requests']:,} ({s['completed']:,} completed, {s['failed']:,} failed)"),
            ("prompt tokens", num(s["prompt_tokens"]) + failed_prompt)]
    rows += [(f"hit tokens {t.upper()}", f"{hits[t]:,} ({100 * hits[t] / prompt:.1f}%)") for t in TIERS]
    if s["metrics"].get("storage_adopted_pages"):  # (--hicache-storage-persist: the last run's L3, adopted)
        rows.append(("L3 adopted at start", f"{s['metrics']['storage_adopted_pages']:,} pages"))
    rows += [("recomputed tokens", f"{s['recomputed_tokens']:,} ({100 * s['recomputed_tokens'] / prompt:.1f}%)"),
             ("TTFT p50/p90/p99 ms", " / ".join(num(s["ttft_ms"][k], "{:.1f}") for k in ("p50", "p90", "p99"))),
             ("throughput", f"{num(s['throughput_req_s'], '{:.2f}')} req/s over {s['wall_s']:.1f} s")]
    rows += [(f"bytes {d.upper()}", f"{s['bytes'][d]:,}") for d in DIRECTIONS]
    if (spec := s.get("speculative")) is not None:
        declined, cached = spec.get("declined_steps", 0), spec.get("cache_drafts", 0)
        rows.append(("speculative drafts", f"{spec['accepted_tokens']:,} of {spec['draft_tokens']:,} tokens accepted "
                                           f"in {spec['verify_steps']:,} verify steps"
                                           + (f" ({declined:,} steps of drafts decoded plainly: the cost policy)"
                                              if declined else "")
                                           + (f"; {cached:,} drafts from the prefix cache, {spec['cache_accepted_tokens']:,}"
                                              " of their tokens accepted" if cached else "")))
    rows += [("preempted", f"{s['preempted']:,} times ({s['preempted_recomputed_tokens']:,} tokens computed again)")
             ] if s.get("preempted") else []
    rows += [("integrity", s["integrity"]), ("outputs digest", s["outputs_digest"][:16])]
    if "compare_no_cache" in s:
        c = s["compare_no_cache"]
        rows.append(("no-cache digest", f"{c['outputs_digest'][:16]} ({'match' if c['match'] else 'MISMATCH'})"))
    if s["problems"]:
        rows.append(("malformed lines", f"{len(s['problems'])} skipped"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def print_summary(s: dict, file=None) -> None:
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_summary(s), file=file)
        return
    table = Table(title="trace replay", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for line in format_summary(s).splitlines():
        key, _, value = line.partition("  ")
        table.add_row(key.strip(), value.strip())
    Console(file=file, width=100).print(table)


# -- entry point ----------------------------------------------------------------------------------
def _replay_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace, config: EngineConfig,
                    items: list[ReplayItem], what: str = "", **kw) -> dict:
    """replay(), or exit 2 with one line when the engine refuses its configuration or its pools."""
    try:
        return replay(config, items, **kw)
    except (ValueError, EngineStartError) as exc:  # a configuration the engine refuses (an L2 of no page)
        parser.exit(2, f"{parser.prog}: {what}{exc}\n")
    except MemoryError as exc:  # pools larger than this process may have after all (a traceback before)
        parser.exit(2, f"{parser.prog}: {what}{replay_memory.out_of_memory(args, config, exc)}\n")
    except sigterm.Terminated:  # (the shell's status of a process SIGTERM killed)
        parser.exit(sigterm.EXIT_STATUS, f"{parser.prog}: {what}terminated (SIGTERM): the engine shut down, its "
                                          "tiers closed; no summary\n")
    except KeyboardInterrupt as exc:  # Ctrl-C: asyncio's runner cancelled the run, as SIGTERM does (regression: a
        # traceback); a second one lands in whatever runs, the engine's shutdown too (not the runner's, after the run)
        shut = isinstance(exc.__context__, asyncio.CancelledError)
        parser.exit(INTERRUPTED_STATUS, f"{parser.prog}: {what}interrupted (Ctrl-C): "
                                        f"{'the engine shut down, its tiers closed' if shut else 'the run stopped'}; "
                                        "no summary\n")


def run_cli(argv: list[str] | None = None) -> dict:
    """Parses, replays, prints; returns the summary. Raises SystemExit on bad input or --strict."""
    parser = build_parser()
    args = parser.parse_args(argv)
    fill_defaults(args)
    check_replay_args(parser, args)
    try:
        config = config_from_replay_args(args)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    model = model_config_of(config.model)
    if args.block_tokens > model.max_position_embeddings:
        # regression: a block is synthesized whole (4 bytes a token) and scales every prompt by
        # block_tokens / 512: 10**9 was a MemoryError traceback, 10**400 an OverflowError one
        parser.exit(2, f"{parser.prog}: --block-tokens {shown(args.block_tokens)}: more than the model's "
                       f"{model.max_position_embeddings:,} positions (a hash id's block is part of one prompt)\n")
    try:
        records, problems = load_trace(args.trace, strict=args.strict, max_requests=args.max_requests)
    except TraceError as exc:
        parser.exit(2, f"{parser.prog}: --strict: {exc}\n")
    except OSError as exc:
        parser.exit(2, f"{parser.prog}: cannot read trace: {exc}\n")
    for p in problems[:MAX_PROBLEMS_SHOWN]:
        print(f"{args.trace}:{p.line_no}: skipped: {p.reason}", file=sys.stderr)
    if len(problems) > MAX_PROBLEMS_SHOWN:  # regression: a trace of bad lines printed each one
        listed = f" ({_flag('json_out')} lists them all)" if args.json_out and records else ""
        print(f"{args.trace}: ... and {len(problems) - MAX_PROBLEMS_SHOWN:,} more malformed lines skipped{listed}",
              file=sys.stderr)
    if not records:
        parser.exit(2, f"{parser.prog}: {args.trace}: no usable request\n")
    check_writable(parser, args.log_json, "log_json")
    check_writable(parser, args.json_out, "json_out")
    items = build_items(records, model.vocab_size, args.block_tokens,
                        seed=args.synth_seed, max_input_tokens=args.max_input_tokens,
                        max_output_tokens=args.max_output_tokens)
    replay_memory.warn_will_fail(parser, args, items, config, model.max_position_embeddings)
    replay_memory.warn_long_waits(parser, args, items)
    options = {k: getattr(args, k) for k in REPLAY_OPTIONS}
    progress = sys.stderr.isatty() and not args.no_progress  # (tqdm draws on stderr: a piped stdout keeps it)
    kw = dict(time_scale=args.time_scale, concurrency=args.concurrency)
    simulated = " (simulated)" if config.simulate else ""
    summary = summarize(_replay_or_exit(parser, args, config, items, progress=progress,
                                        announce=f"{parser.prog}: replaying {args.trace}{simulated}: ", **kw),
                        problems, config, options)
    if args.compare_no_cache:
        if config.log_json:  # keep the baseline's events out of this run's timeline
            from scheduler.logs import configure_logging
            configure_logging(None)
        base_cfg = dataclasses.replace(config.with_hicache(enable=False), enable_prefix_cache=False, log_json=None)
        # (regression: a baseline engine that could not start was a traceback after the replay's summary)
        base = _replay_or_exit(parser, args, base_cfg, items, progress=progress, rid_prefix="nocache-",
                               what="--compare-no-cache baseline: ",
                               announce=f"{parser.prog}: replaying {args.trace}{simulated} (--compare-no-cache "
                                        "baseline): ", **kw)
        digest = outputs_digest(base["outcomes"])
        summary["compare_no_cache"] = {"outputs_digest": digest, "match": digest == summary["outputs_digest"],
                                       "failed": sum(o.error is not None for o in base["outcomes"]),
                                       "wall_s": base["wall_s"]}
    print_summary(summary)
    for e in summary["errors"][:MAX_PROBLEMS_SHOWN]:
        print(f"request {e['index']} (line {e['line']}) failed: {e['error']}", file=sys.stderr)
    if len(summary["errors"]) > MAX_PROBLEMS_SHOWN:  # (regression: the rest went unsaid)
        print(f"... and {len(summary['errors']) - MAX_PROBLEMS_SHOWN:,} more failed requests", file=sys.stderr)
    if args.json_out:
        try:
            Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_out).write_text(json.dumps(summary, indent=2, default=str) + "\n")
        except OSError as exc:  # (it could be written before the run: one line, the summary above kept)
            parser.exit(2, f"{parser.prog}: error: --json-out: cannot write {args.json_out}: {exc.strerror or exc}\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        summary = run_cli(argv)
    except KeyboardInterrupt:  # Ctrl-C before the replay's run (reading a large trace) or after it: nothing of the
        # engine runs then (regression: a traceback; one during the run is `_replay_or_exit`'s)
        print(f"{os.path.basename(sys.argv[0])}: interrupted (Ctrl-C); no summary", file=sys.stderr)
        return INTERRUPTED_STATUS
    if summary["completed"] == 0:
        print(f"{os.path.basename(sys.argv[0])}: no request completed", file=sys.stderr)
        return 1
    mismatch = "compare_no_cache" in summary and not summary["compare_no_cache"]["match"]
    return 1 if summary["engine_crash"] or summary["integrity"] != "passed" or mismatch else 0


if __name__ == "__main__":  # (python -m scheduler.replay; regression: it ran nothing and exited 0)
    sys.exit(main())

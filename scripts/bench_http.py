"""Serving over HTTP against the same engine in process: what the OpenAI-compatible layer (FastAPI on
uvicorn, sharing the engine's event loop) costs a decode batch. BATCH concurrent completions of PROMPT
random token ids (new ones each round), NEW tokens each (ignore_eos), first through the engine in
process, then through a server process (`python -m scheduler.server`, the same engine flags) streamed
and not, from a client in this process (httpx, one connection a request). On a 2-core CPU the client
and the server share the cores with the engine's compute: only the GPU's figures say what HTTP costs.

    python scripts/bench_http.py --model tiny --device cpu --quick    # CPU smoke
    python scripts/bench_http.py --model qwen3-8b --batch 32 --prompt-tokens 512 --new-tokens 256

Tokens/s counts from the last request's first token to the last token (the decode window, as
bench_engine's decode rate); TTFT and inter-token times are per request, over the batch.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cli import check_device, human_output, positive_int, refused_as_usage  # noqa: E402
from bench_common import add_common_args, percentile, write_result  # noqa: E402
from scheduler.api_auth import api_key_from  # noqa: E402
from scheduler.config import add_engine_args, config_from_args  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.presets import model_config_of  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402


def summary(marks: list[list[float]], start_s: float, new_tokens: int) -> dict:
    """marks: per request, the arrival time of each token (a streamed chunk may carry several: each
    counts at its chunk's time). -> tokens/s over the decode window, TTFT and inter-token quantiles."""
    firsts, lasts = [m[0] for m in marks], [m[-1] for m in marks]
    window_s = max(lasts) - max(firsts)
    gaps = [b - a for m in marks for a, b in zip(m, m[1:])]
    return {"tok_s": len(marks) * (new_tokens - 1) / max(window_s, 1e-9), "batch_ms": (max(lasts) - start_s) * 1e3,
            "ttft_p50_ms": percentile([f - start_s for f in firsts], 50) * 1e3,
            "ttft_max_ms": max(firsts) * 1e3 - start_s * 1e3,
            "itl_p50_ms": percentile(gaps, 50) * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3}


async def in_process(args, batches) -> dict:
    engine = Engine(config_from_args(args))
    await engine.start()
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=args.temperature, seed=1)

    async def one(prompt) -> list[float]:
        return [time.perf_counter() async for ev in engine.submit(prompt, params) if ev.token_id is not None]
    out = {}
    for _ in range(args.rounds):
        prompts = next(batches)
        start = time.perf_counter()
        marks = await asyncio.gather(*(one(p) for p in prompts))
        out = summary(marks, start, args.new_tokens)  # the last round's (the first warms up)
    await engine.shutdown()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_settings() -> dict:
    """httpx's settings for calls to the server this script starts: on this machine, so never through a proxy of
    the environment's (HTTP_PROXY and the like); with the key that server takes from HICACHE_API_KEY, which it
    inherits (regression: with the variable set, every call was refused 401 and the benchmark ended in a
    traceback)."""
    key = api_key_from(None)
    return {"trust_env": False, "headers": {"Authorization": f"Bearer {key}"} if key else {}}


async def over_http(url: str, args, batches, stream: bool) -> dict:
    body = {"max_tokens": args.new_tokens, "ignore_eos": True, "temperature": args.temperature, "seed": 1,
            "stream": stream}
    limits = httpx.Limits(max_connections=args.batch + 1, max_keepalive_connections=args.batch + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, **client_settings()) as client:
        async def one(prompt) -> list[float]:
            if not stream:
                r = await client.post("/v1/completions", json={**body, "prompt": prompt})
                r.raise_for_status()
                n = len(r.json()["choices"][0]["token_ids"])
                return [time.perf_counter()] * n
            marks = []
            async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        now = time.perf_counter()
                        for choice in json.loads(line[6:])["choices"]:
                            marks += [now] * len(choice["token_ids"])
            return marks
        out = {}
        for _ in range(args.rounds):
            prompts = next(batches)
            start = time.perf_counter()
            marks = await asyncio.gather(*(one(p) for p in prompts))
            assert all(len(m) == args.new_tokens for m in marks), [len(m) for m in marks]
            out = summary(marks, start, args.new_tokens) if stream else {
                "batch_ms": (max(m[-1] for m in marks) - start) * 1e3}  # (no token times: the whole batch)
        return out


BENCH_FLAGS = {"--batch": 1, "--prompt-tokens": 1, "--new-tokens": 1, "--temperature": 1, "--rounds": 1,
               "--quick": 0, "--json": 0, "--out": 1}  # this script's own flags: how many values each takes


def engine_flags(argv: list[str]) -> list[str]:
    """argv without this script's own flags: the engine flags the server gets too."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
        elif a.split("=")[0] in BENCH_FLAGS:
            skip = 0 if "=" in a else BENCH_FLAGS[a]
        else:
            out.append(a)
    return out


def serve(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "scheduler.server", *args.engine_flags, "--device", args.device,
           "--port", str(port), "--disable-access-log", "--log-level", "warning",
           "--max-tokens-limit", str(max(args.new_tokens, 16)),
           "--max-concurrent-requests", str(max(args.batch, 1))]
    log = tempfile.TemporaryFile()  # its output, shown if it fails to start
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), stdout=log,
                            stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def server_log(proc: subprocess.Popen, lines: int = 30) -> str:
    proc.log.seek(0)
    return "\n".join(proc.log.read().decode(errors="replace").splitlines()[-lines:])


async def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=5, **client_settings()) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode}:\n{server_log(proc)}")
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError("the server did not answer /health in time")


def main(argv: list[str] | None = None) -> int:
    # allow_abbrev off: the engine's flags are passed on to the server as typed, and an abbreviated
    # bench flag (--batch-s 8 for --batch) would reach the server too (regression: tests/test_review_s36.py)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_engine_args(ap)
    ap.add_argument("--batch", type=positive_int, default=32)
    ap.add_argument("--prompt-tokens", type=positive_int, default=512)
    ap.add_argument("--new-tokens", type=positive_int, default=256,
                    help="tokens a request generates (at least 2: the inter-token times need two)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=positive_int, default=2, help="each mode runs this many batches; the last counts")
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke)")
    add_common_args(ap)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    args.engine_flags = engine_flags(argv)
    if args.quick:
        args.batch, args.prompt_tokens, args.new_tokens = 8, 32, 64
    if not any(a.split("=")[0] in ("--max-total-tokens", "--num-pages") for a in argv):
        # L1 for the whole batch at once, the same in process and in the server (the CLI's default sizes
        # L1 from the GPU's free memory, which the other engine's weights share)
        args.max_total_tokens = args.batch * (args.prompt_tokens + args.new_tokens + 64)
        args.engine_flags += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.device == "auto":
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.new_tokens < 2:  # (regression: a traceback from the inter-token quantiles of no gaps)
        ap.error(f"--new-tokens must be >= 2 (the inter-token times need two tokens), got {args.new_tokens}")
    check_device(ap, args.device)
    with refused_as_usage(ap):  # what the engine would refuse, before either engine starts
        config = config_from_args(args)
        SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=args.temperature,
                       seed=1).validate(config.max_new_tokens_limit)
    rng = random.Random(0)
    vocab_hi = model_config_of(args.model).vocab_size

    def fresh_batches():  # new prompts every round (none a prefix-cache hit), the same sizes everywhere
        while True:
            yield [[rng.randrange(1, vocab_hi) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
    batches = fresh_batches()
    out = {"model": args.model, "device": args.device, "date": time.strftime("%Y-%m-%d"), "batch": args.batch,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "temperature": args.temperature}
    out["in_process"] = asyncio.run(in_process(args, batches))
    if args.device == "cuda":
        import gc

        import torch
        gc.collect()
        torch.cuda.empty_cache()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(args, port)
    try:
        asyncio.run(wait_ready(url, proc))
        out["http_stream"] = asyncio.run(over_http(url, args, batches, stream=True))
        out["http_whole"] = asyncio.run(over_http(url, args, batches, stream=False))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    write_result(out, args.out, args.json)
    with human_output(args.json):  # (regression: the summary followed the JSON on stdout)
        human(args, out)
    return 0


def human(args, out: dict) -> None:
    base, base_ms = out["in_process"]["tok_s"], out["in_process"]["batch_ms"]
    print(f"\n{args.model} on {args.device}: batch {args.batch} x {args.prompt_tokens}-token prompts, "
          f"{args.new_tokens} new tokens, temperature {args.temperature}")
    for mode in ("in_process", "http_stream", "http_whole"):
        r = out[mode]
        rate = (f"decode {r['tok_s']:6.0f} tok/s ({r['tok_s'] / base:.3f}), TTFT p50 {r['ttft_p50_ms']:.1f} ms, "
                f"inter-token p50 / p99 {r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} ms" if "tok_s" in r else "")
        print(f"  {mode:12s} whole batch {r['batch_ms']:7.0f} ms ({r['batch_ms'] / base_ms:.3f} of in process)"
              + (f"; {rate}" if rate else ""))


if __name__ == "__main__":
    sys.exit(main())

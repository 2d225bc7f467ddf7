"""Engine smoke benchmark: prefill cost per token (paged engine vs a plain dense SDPA forward of the
same model), decode tokens/s at several batch sizes, and the one-token tail forward over a cached
prefix against the weight-read floor, with and without CUDA graphs.

    python scripts/bench_engine.py --model qwen3-8b --json            # on the GPU
    python scripts/bench_engine.py --model tiny --device cpu --quick   # CPU smoke
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_cli import (check_device, choice_list, fail, human_output, int_list, positive_int,  # noqa: E402
                       refused_as_usage)
from bench_common import (add_common_args, device_read_gib_s, forward_read_bytes, free_memory,  # noqa: E402
                          tail_forward_s, write_result)
from scheduler.config import FP32_LM_HEAD_OFF, EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.guided import GuidedSpec  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402
from scheduler.runner import BatchInput  # noqa: E402
from scheduler.tokenizer import HFTokenizer  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


VOCAB_LO = 1
vocab_hi = 512  # set from the model's vocabulary at start


async def ttft(engine: Engine, prompt, n=1) -> float:
    t = time.perf_counter()
    async for ev in engine.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        if ev.finished:
            break
    return time.perf_counter() - t


PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
# --sampled-decode's variants: what a chat client sends, unseeded and seeded, then with vLLM's top_k and min_p
SAMPLED = {"sampled": {"temperature": 0.8, "top_p": 0.95},
           "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 1},
           "top_k_min_p": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "min_p": 0.05, "seed": 1},
           "qwen3_defaults": {"temperature": 0.6, "top_p": 0.95, "top_k": 20}}  # Qwen3's generation_config.json


def bans(rng, vocab: int) -> dict[str, dict]:
    """--banned-decode's variants: half the vocabulary allowed (a mask made once per request); 8 one-token and 120 two-token bad words (vLLM's
    cap is 128 words): each two-token word's first token may be the one in flight, so every chained step
    compares all 120 on the device."""
    words = tuple((rng.randrange(VOCAB_LO, vocab),) for _ in range(8)) + \
        tuple((rng.randrange(VOCAB_LO, vocab), rng.randrange(VOCAB_LO, vocab)) for _ in range(120))
    return {"allowed_half": {"allowed_token_ids": tuple(range(0, vocab, 2))},
            "bad_words_128": {"bad_words_token_ids": words}}


# --guided-decode's grammars (--guided-grammar), never complete, so each row runs its tokens: text, or a JSON list of
# tool-call-like arguments left open (a string of up to 24 characters, an integer, an enum, again and again)
ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days", "unit"], "additionalProperties": False}
FREE = {**ARGS, "properties": {**ARGS["properties"], "city": {"type": "string"}}}  # (a string of any length)
GRAMMARS = {"text": GuidedSpec("regex", "[a-z ]+"),
            "json": GuidedSpec("grammar", 'start: "[" item ("," item)*\nitem: %json ' + json.dumps(ARGS)),
            "json_free": GuidedSpec("grammar", 'start: "[" item ("," item)*\nitem: %json ' + json.dumps(FREE))}


async def decode_rate(engine: Engine, batch: int, prompt_tokens: int, new_tokens: int, rng, guided: int = 0,
                      spec: GuidedSpec = GRAMMARS["text"], **params) -> float:
    """Decode tokens/s of `batch` requests decoding together (from the last first token to the last token);
    params: SamplingParams' extra fields (e.g. PENALTIES); the first `guided` requests also held to `spec`."""
    prompts = [[rng.randrange(VOCAB_LO, vocab_hi) for _ in range(prompt_tokens)] for _ in range(batch)]
    marks = {}

    async def one(i, p):
        first = None
        grammar = {"guided": spec} if i < guided else {}
        async for ev in engine.submit(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True, **params, **grammar)):
            if first is None:
                first = time.perf_counter()
            if ev.finished:
                marks[i] = (first, time.perf_counter())
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    start = max(m[0] for m in marks.values())
    end = max(m[1] for m in marks.values())
    return batch * (new_tokens - 1) / max(end - start, 1e-9)


async def profile_tail(engine: Engine, cached: list[int], rng) -> dict:
    """Where a tail request's time goes: device busy time (sum of kernel and copy durations) against
    the request's wall time, and the top kernels, from torch.profiler over 3 requests."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(3):
            await ttft(engine, cached + [rng.randrange(VOCAB_LO, vocab_hi)])
        wall = (time.perf_counter() - t) / 3
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / 3
    import cProfile
    import io
    import pstats

    cpu = cProfile.Profile()  # the loop thread's Python time per request
    cpu.enable()
    for _ in range(5):
        await ttft(engine, cached + [rng.randrange(VOCAB_LO, vocab_hi)])
    cpu.disable()
    text = io.StringIO()
    pstats.Stats(cpu, stream=text).sort_stats("tottime").print_stats(18)
    print("tail request, loop-thread Python (cProfile, 5 requests):")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:4000])
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
    print(f"tail request profile: wall {wall * 1e3:.2f} ms, device busy {device_us / 1e3:.2f} ms per request")
    for e in top:
        print(f"  {e.self_device_time_total / 3 / 1e3:7.3f} ms  {e.count // 3:5d} x  {e.key[:90]}")
    return {"wall_ms": wall * 1e3, "device_busy_ms": device_us / 1e3,
            "top_kernels": [{"name": e.key[:120], "ms": e.self_device_time_total / 3 / 1e3, "calls": e.count // 3}
                            for e in top]}


async def profile_decode(engine: Engine, batch: int, rng) -> dict:
    """Top device kernels and busy time of a decode run (batch x 512-token prompts, 16 new tokens)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        await decode_rate(engine, batch, 512, 16, rng)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:10]
    busy = sum(e.self_device_time_total for e in events) / 1e3
    print(f"decode b{batch} profile: wall {wall * 1e3:.1f} ms, device busy {busy:.1f} ms")
    for e in top:
        print(f"  {e.self_device_time_total / 1e3:8.3f} ms  {e.count:5d} x  {e.key[:90]}")
    return {"wall_ms": wall * 1e3, "device_busy_ms": busy,
            "top_kernels": [{"name": e.key[:120], "ms": e.self_device_time_total / 1e3, "calls": e.count}
                            for e in top]}


def engine_config(args, graphs: bool = False, small_gemm: str = "triton") -> EngineConfig:
    return EngineConfig(model=args.model, device=args.device, page_size=args.page_size,
                        max_total_tokens=args.pool_tokens, max_prefill_tokens=16384, cuda_graphs=graphs,
                        small_gemm=small_gemm, max_running_requests=64, fp32_lm_head=not args.disable_fp32_lm_head)


EXTRA_DECODES = ("penalized_decode", "banned_decode", "sampled_decode", "guided_decode")


def refusal(engine: Engine, args) -> str | None:
    """What `engine` would refuse of the requests the flags make (each shape: prompt tokens, new tokens), else None."""
    shapes = [(n, 1) for n in args.prefill_tokens] + [(args.tail_context + 1, 1),
                                                      (args.decode_prompt, args.decode_tokens)]
    shapes += [(p, t) for name in EXTRA_DECODES if getattr(args, name) for _, p, t in [getattr(args, name)]]
    for prompt_tokens, new_tokens in shapes:
        try:
            engine.validate([VOCAB_LO] * prompt_tokens, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        except ValueError as exc:
            return f"{exc} (a request of {prompt_tokens} prompt tokens and {new_tokens} new ones)"
    return None


async def run(args) -> dict:
    rng = random.Random(0)
    out: dict = {"model": args.model, "device": args.device, "date": time.strftime("%Y-%m-%d")}
    start_read_gib_s = device_read_gib_s(torch.device(args.device))  # the copy rate, fresh and at the end
    results = {}
    # (mode, CUDA graphs, small-forward projections): graphs with each --small-gemm backend, then eager
    modes = [("eager", False, args.small_gemm[0])]
    if args.device == "cuda":
        graph_modes = [("graphs" if i == 0 else f"graphs_{b}", True, b) for i, b in enumerate(args.small_gemm)]
        modes = graph_modes + ([] if args.skip_eager else modes)
    for mode, graphs, small_gemm in modes:
        engine = Engine(engine_config(args, graphs, small_gemm))
        global vocab_hi
        vocab_hi = engine.vocab_size
        refused = refusal(engine, args)
        if refused:  # (regression: a RequestError's traceback, some after the main benchmark had run)
            fail(refused)
        device = engine.device
        await engine.start()
        r: dict = {}
        if graphs or args.device != "cuda":
            r["prefill_us_per_token"] = {}
            r["dense_us_per_token"] = {}
            for n in args.prefill_tokens:
                times = []
                for _ in range(args.repeats):
                    prompt = [rng.randrange(VOCAB_LO, vocab_hi) for _ in range(n)]
                    times.append(await ttft(engine, prompt))
                r["prefill_us_per_token"][n] = statistics.median(times) / n * 1e6
                ids = torch.tensor(prompt, device=device)
                with torch.inference_mode():
                    engine.model.forward_dense(ids, last_only=True)
                    dense = []
                    for _ in range(args.repeats):
                        sync(device)
                        t = time.perf_counter()
                        engine.model.forward_dense(ids, last_only=True)
                        sync(device)
                        dense.append(time.perf_counter() - t)
                r["dense_us_per_token"][n] = statistics.median(dense) / n * 1e6
        cached = [rng.randrange(VOCAB_LO, vocab_hi) for _ in range(args.tail_context)]
        await ttft(engine, cached + [7])  # now cached in L1
        tails = [await ttft(engine, cached + [rng.randrange(VOCAB_LO, vocab_hi)]) for _ in range(args.repeats)]
        r["tail_forward_ms"] = statistics.median(tails) * 1e3
        # the forward alone (no request bookkeeping): one new token over the cached prefix, and the
        # tail a restore of this prompt leaves (its last partial page and the new token: 13 tokens
        # at 3,500 cached and 16-token pages), the issue's "uncached tail after a restore"
        m = engine.cache.match(cached)
        pages = list(m.pages[0]) + [m.pages[0][-1]]
        pos = m.lengths[0] - 1  # rewrite the last cached slot's K/V with itself: harmless
        binput = BatchInput([cached[pos]], [pos], [1], [pages], [0.0], [1.0], [None], is_decode=False)
        fwd, launch = [], []
        for _ in range(args.repeats + 2):
            sync(device)
            t = time.perf_counter()
            handle = engine.runner.launch(binput)
            launch.append(time.perf_counter() - t)
            await engine.runner.collect(handle)
            fwd.append(time.perf_counter() - t)
        r["forward_1tok_ms"] = statistics.median(fwd[2:]) * 1e3
        r["launch_1tok_ms"] = statistics.median(launch[2:]) * 1e3  # host time until launch() returns
        ps = engine.page_size
        r["tail_tokens"] = args.tail_context + 1 - args.tail_context // ps * ps
        r["forward_tail_ms"] = statistics.median(
            await tail_forward_s(engine, cached, r["tail_tokens"], args.repeats)) * 1e3
        r["decode_tok_s"] = {b: await decode_rate(engine, b, args.decode_prompt, args.decode_tokens, rng)
                             for b in args.decode_batches}
        if args.penalized_decode:  # what the penalties cost a decode step, over long outputs
            b, p, t = args.penalized_decode
            r["penalized_decode_tok_s"] = {"batch": b, "prompt_tokens": p, "new_tokens": t,
                                           "plain": await decode_rate(engine, b, p, t, rng),
                                           "penalized": await decode_rate(engine, b, p, t, rng, **PENALTIES)}
        if args.banned_decode:  # what allowed_token_ids and bad words cost a decode step
            b, p, t = args.banned_decode
            r["banned_decode_tok_s"] = {"batch": b, "prompt_tokens": p, "new_tokens": t,
                                        "plain": await decode_rate(engine, b, p, t, rng),
                                        **{name: await decode_rate(engine, b, p, t, rng, **kw)
                                           for name, kw in bans(rng, vocab_hi).items()}}
        if args.sampled_decode:  # what sampling costs a decode step against greedy
            b, p, t = args.sampled_decode
            r["sampled_decode_tok_s"] = {"batch": b, "prompt_tokens": p, "new_tokens": t,
                                         "greedy": await decode_rate(engine, b, p, t, rng)}
            for name, params in SAMPLED.items():
                r["sampled_decode_tok_s"][name] = await decode_rate(engine, b, p, t, rng, **params)
        if args.guided_decode:  # what structured outputs cost a decode batch: none, one, every row guided
            b, p, t = args.guided_decode
            r["guided_decode_tok_s"] = {"batch": b, "prompt_tokens": p, "new_tokens": t, "grammar": args.guided_grammar,
                                        "tokenizer": args.guided_tokenizer or "bytes"}
            if args.guided_tokenizer:
                engine.guides.use(args.guided_tokenizer_loaded)
                engine.guides.warm()
            # every row guided twice: llguidance computes a grammar state's mask once and keeps it for every request
            # of the spec (the first pass pays for the states it meets first; a served schema's are mostly known)
            for k, key in ((0, "guided_0"), (1, "guided_1"), (b, f"guided_{b}"), (b, f"guided_{b}_again")):
                r["guided_decode_tok_s"][key] = await decode_rate(engine, b, p, t, rng, guided=k,
                                                                  spec=GRAMMARS[args.guided_grammar])
        # the profiles last, in the last mode: after torch.profiler this process's CUDA calls stay
        # slower (its CUPTI hooks; a graph replay's host time 3-9x, session 26), so a timing taken
        # after it counts them (session 25's run 9: the one-token launch at 0.52 ms of host time
        # against 0.13-0.39 in processes without the profiler)
        if args.profile and device.type == "cuda" and mode == modes[-1][0]:
            r["tail_profile"] = await profile_tail(engine, cached, rng)
            r["decode_profile"] = await profile_decode(engine, 32, rng)
        engine.check_integrity()
        r["integrity"] = "passed"
        weight_bytes = forward_read_bytes(engine.model)
        await engine.shutdown()
        results[mode] = r
        del engine
        free_memory()  # the engine's pools sit in reference cycles: without a collection, 3 modes of 8B do not fit
    read_gib_s = max(start_read_gib_s, device_read_gib_s(torch.device(args.device)))  # the faster: a lower floor
    out["weight_bytes"] = weight_bytes  # what a forward reads (forward_read_bytes: not the input embedding)
    out["device_read_gib_s"] = read_gib_s
    out["weight_read_floor_ms"] = weight_bytes / (read_gib_s * (1 << 30)) * 1e3 if read_gib_s else None
    out["results"] = results
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, model="qwen3-8b", device=True, page_size=16)  # (--model: qwen3-8b on the CPU too)
    ap.add_argument("--pool-tokens", type=positive_int, default=200_000)
    ap.add_argument("--prefill-tokens", type=int_list(1), default=[350, 1000, 3500], help="comma list")
    ap.add_argument("--decode-batches", type=int_list(1), default=[1, 32], help="comma list")
    ap.add_argument("--decode-prompt", type=positive_int, default=512)
    ap.add_argument("--decode-tokens", type=positive_int, default=64,
                    help="tokens a decode request generates (at least 2: the rate counts those after the first)")
    ap.add_argument("--tail-context", type=positive_int, default=3500, help="cached tokens (at least a page)")
    triple = int_list(1, length=3)
    ap.add_argument("--penalized-decode", type=triple, metavar="BATCH,PROMPT,TOKENS",
                    help="also decode BATCH requests of PROMPT tokens for TOKENS tokens with and without "
                         "presence, frequency and repetition penalties (e.g. 32,2000,512)")
    ap.add_argument("--banned-decode", type=triple, metavar="BATCH,PROMPT,TOKENS",
                    help="also decode BATCH requests of PROMPT tokens for TOKENS tokens plain, with half the "
                         "vocabulary allowed (allowed_token_ids) and with 128 bad words (e.g. 32,512,128)")
    ap.add_argument("--sampled-decode", type=triple, metavar="BATCH,PROMPT,TOKENS",
                    help="also decode BATCH requests of PROMPT tokens for TOKENS tokens greedily and sampled "
                         "(temperature 0.8, top_p 0.95; seeded; with top_k 50 and min_p 0.05; Qwen3's defaults: temperature "
                         "0.6, top_k 20, top_p 0.95), e.g. 32,512,256")
    ap.add_argument("--guided-decode", type=triple, metavar="BATCH,PROMPT,TOKENS",
                    help="also decode BATCH requests with none, one and all of them held to a regex (structured "
                         "outputs: host-made masks, steps not chained), e.g. 32,512,128")
    ap.add_argument("--guided-grammar", choices=sorted(GRAMMARS), default="text",
                    help="--guided-decode's grammar: text ([a-z ]+), json (tool-call arguments, again and again, "
                         "their string of at most 24 characters) or json_free (that string of any length)")
    ap.add_argument("--guided-tokenizer", metavar="DIR",
                    help="--guided-decode's masks for this tokenizer.json's vocabulary (scripts/make_bpe_tokenizer.py) "
                         "rather than the presets' byte tokenizer")
    ap.add_argument("--repeats", type=positive_int, default=8)
    ap.add_argument("--disable-fp32-lm-head", action="store_true", help=FP32_LM_HEAD_OFF)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler breakdown of the tail request (CUDA), after every timing of the last mode")
    ap.add_argument("--small-gemm", type=choice_list(("triton", "cublas")), default="triton",
                    help="comma list of triton / cublas: the graphs mode once per backend of the small projections")
    ap.add_argument("--skip-eager", action="store_true", help="CUDA: leave out the eager mode")
    args = ap.parse_args(argv)
    if args.quick:
        args.pool_tokens, args.prefill_tokens, args.decode_batches = 4096, [32, 64], [1, 4]
        args.decode_prompt, args.decode_tokens, args.tail_context, args.repeats = 16, 4, 64, 2
    check_args(ap, args)
    out = asyncio.run(run(args))
    write_result(out, args.out, args.json)
    with human_output(args.json):  # (regression: the summary followed the JSON on stdout)
        human(args, out)
    return 0


def check_args(ap, args) -> None:
    """What the run would fail on, refused before it (regression: the extra decodes' flags were parsed, and failed,
    after the main benchmark had run)."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device}: not a torch device (cpu, cuda, cuda:N)")
    check_device(ap, device.type)
    if args.decode_tokens < 2:  # (regression: decode tok/s 0: the rate counts the tokens after the first)
        ap.error(f"--decode-tokens must be >= 2, got {args.decode_tokens}")
    for name in EXTRA_DECODES:
        if getattr(args, name) and getattr(args, name)[2] < 2:
            ap.error(f"--{name.replace('_', '-')}: TOKENS must be >= 2, got {getattr(args, name)[2]}")
    with refused_as_usage(ap, "engine config"):
        config = engine_config(args)
    if args.tail_context < config.page_size:  # (regression: an IndexError: no whole page cached)
        ap.error(f"--tail-context {args.tail_context} must be at least a page ({config.page_size} tokens)")
    if args.guided_tokenizer:
        if not args.guided_decode:
            ap.error("--guided-tokenizer is --guided-decode's: give that too")
        with refused_as_usage(ap, "--guided-tokenizer"):
            args.guided_tokenizer_loaded = HFTokenizer(args.guided_tokenizer)


def human(args, out: dict) -> None:
    floor = out["weight_read_floor_ms"]
    print(f"\n{args.model} on {args.device}; weight-read floor {floor and round(floor, 2)} ms")
    for mode, r in out["results"].items():
        for n, us in r.get("prefill_us_per_token", {}).items():
            print(f"  prefill {n:>5} tok: {us:7.1f} us/tok (dense SDPA {r['dense_us_per_token'][n]:7.1f})")
        print(f"  [{mode}] tail request over {args.tail_context} cached: {r['tail_forward_ms']:.2f} ms "
              f"(forward alone {r['forward_1tok_ms']:.2f} ms, launch {r['launch_1tok_ms']:.2f}); decode tok/s "
              + ", ".join(f"b{b}={v:.0f}" for b, v in r["decode_tok_s"].items()))
        if floor:
            b1_ms = 1e3 / r["decode_tok_s"][1] if 1 in r["decode_tok_s"] else float("nan")
            print(f"  [{mode}] x floor: {r['tail_tokens']}-token tail forward {r['forward_tail_ms']:.2f} ms = "
                  f"{r['forward_tail_ms'] / floor:.2f}, one-token forward {r['forward_1tok_ms'] / floor:.2f}, "
                  f"batch-1 decode step {b1_ms:.2f} ms = {b1_ms / floor:.2f}")
        if "penalized_decode_tok_s" in r:
            pd = r["penalized_decode_tok_s"]
            print(f"  [{mode}] decode b{pd['batch']} over {pd['prompt_tokens']}-token prompts, {pd['new_tokens']} "
                  f"tokens: {pd['plain']:.0f} tok/s plain, {pd['penalized']:.0f} penalized "
                  f"({pd['penalized'] / pd['plain']:.3f})")
        if "banned_decode_tok_s" in r:
            bd = r["banned_decode_tok_s"]
            print(f"  [{mode}] decode b{bd['batch']} over {bd['prompt_tokens']}-token prompts, {bd['new_tokens']} "
                  f"tokens: {bd['plain']:.0f} tok/s plain, " + ", ".join(
                      f"{name} {bd[name]:.0f} ({bd[name] / bd['plain']:.3f})" for name in ("allowed_half", "bad_words_128")))
        if "sampled_decode_tok_s" in r:
            sd = r["sampled_decode_tok_s"]
            print(f"  [{mode}] decode b{sd['batch']} over {sd['prompt_tokens']}-token prompts, {sd['new_tokens']} "
                  f"tokens: {sd['greedy']:.0f} tok/s greedy; "
                  + ", ".join(f"{name} {sd[name]:.0f} ({sd[name] / sd['greedy']:.3f})" for name in SAMPLED))
        if "guided_decode_tok_s" in r:
            gd = r["guided_decode_tok_s"]
            rates = {k: v for k, v in gd.items() if k.startswith("guided_")}
            print(f"  [{mode}] decode b{gd['batch']}, {gd['new_tokens']} tokens, {gd['grammar']} grammar, "
                  f"{gd['tokenizer']} tokenizer, rows guided: "
                  + ", ".join(f"{k[7:]} {v:.0f} tok/s ({v / rates['guided_0']:.3f})" for k, v in rates.items()))


if __name__ == "__main__":
    sys.exit(main())

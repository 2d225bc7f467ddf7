"""Speculative decoding by prompt lookup (`--speculative-config`, scheduler/speculative.py): what a verify step
costs against a decode step, and decode tokens/s with and without it (greedy, or sampled at --temperature and
--top-p, with --repetition-penalty; the cost policy or --draft-policy always). One engine, both ways in turn
(speculation switched off by taking its Speculator away; the verify graphs stay captured).

  1. Step cost: B sequences over a cached context of --context tokens, a decode step (one row each) against
     a verify step of k drafts each (k + 1 rows each, in the engine's verify graph of R rows a sequence: k + 1
     rounded up to a power of two for --num-speculative-tokens; --drafts above that are left out), ms a step,
     launch to tokens on the host. The rows are the cached prompt's last tokens, rewritten in place (as
     bench_engine.py's tail forward).
  2. Decode: B requests of --prompt-tokens tokens each generate --max-tokens tokens together; tokens/s
     of each run, the tokens produced over its seconds (the median of --repeats rounds; prefill included, L1
     emptied before each run, on and off in turn, the order alternating by round), the drafts accepted, and
     whether every output equals the one without speculation (a request that fails ends the run, exit 1: no
     figures). Workloads: "random" prompts (drafts come from the answer's own repeats),
     "repeat" prompts (one block of --block-tokens repeated: drafts from the prompt too) and "again": random
     prompts served once (untimed), then timed as they are served again, their prompts prefix-cache
     hits both ways and, with speculation, their drafts what followed them in the cache (`cache_lookup`: the
     first answers; bf16 rounding can still reject them). With --oracle-drafts also "oracle": each request's
     drafts are the tokens the same prompt got without speculation (what a proposer that is always right gives;
     a verify step still decides).

    python scripts/bench_speculative.py                                   # GPU: qwen3-8b shape
    python scripts/bench_speculative.py --model tiny --device cpu --batches 1,2 --drafts 1,3 --max-tokens 24
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_cli import (check_device, check_engine_config, fail, int_list, non_negative_float,  # noqa: E402
                       positive_int, refused_as_usage, request_errors)
from bench_common import (CPU_SMOKE, add_common_args, evict, fmt, integrity_of, median,  # noqa: E402
                          parse_common_args, sync, table, write_result)
from scheduler.config import FP32_LM_HEAD_OFF, EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402
from scheduler.runner import BatchInput  # noqa: E402
from scheduler.speculative import SpeculativeConfig, verify_rows  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, model=CPU_SMOKE, device=("cuda", "cpu"), seed=0)
    p.add_argument("--num-speculative-tokens", type=positive_int, default=5,
                   help="k of the engine's config (default 5)")
    # (a bound left out takes the other's value, as --speculative-config's: SpeculativeConfig; neither: 4..4)
    p.add_argument("--prompt-lookup-max", type=positive_int, default=None, help="(default: min, or 4)")
    p.add_argument("--prompt-lookup-min", type=positive_int, default=None, help="(default: max, or 4)")
    p.add_argument("--batches", type=int_list(1), default=[1, 4, 8], help="comma-separated batch sizes")
    p.add_argument("--drafts", type=int_list(1), default=[1, 3, 5, 10, 15],
                   help="comma-separated drafts a verify step, for the step cost (those above "
                        "--num-speculative-tokens are left out)")
    p.add_argument("--context", type=positive_int, default=1000,
                   help="cached tokens under the step-cost steps (more than a page + the most drafts)")
    p.add_argument("--prompt-tokens", type=positive_int, default=512)
    p.add_argument("--block-tokens", type=positive_int, default=64, help="the repeat workload's block")
    p.add_argument("--max-tokens", type=positive_int, default=256, help="tokens each request generates")
    p.add_argument("--oracle-drafts", action="store_true", help="also the oracle workload (module doc)")
    p.add_argument("--draft-policy", default="cost", choices=["cost", "always"],
                   help="verify when the drafts expected to be accepted pay for the step (default), or whenever one is found")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--disable-fp32-lm-head", action="store_true", help=FP32_LM_HEAD_OFF)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the requests' and step-cost rows' temperature (default 0: greedy; > 0: drafts accepted by "
                        "rejection sampling, no seed)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature (default 1.0: off)")
    p.add_argument("--repetition-penalty", type=non_negative_float, default=1.0,
                   help="the decode workloads' requests' (default 1.0: off; Qwen2.5's generation config sets 1.05): "
                        "each verify row scored after its drafts")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed rounds (step cost: steps) per configuration")
    args = parse_common_args(p, argv)
    check_device(p, args.device)
    if args.prompt_lookup_max is None and args.prompt_lookup_min is None:
        args.prompt_lookup_max = args.prompt_lookup_min = 4
    # what the engine and its requests would refuse, refused here before anything loads (regression: requests that
    # all failed were timed as tokens produced: 1.7e9 tok/s, exit 0)
    args.spec = check_engine_config(p, lambda: SpeculativeConfig(
        args.num_speculative_tokens, args.prompt_lookup_max, args.prompt_lookup_min, draft_policy=args.draft_policy),
        "speculative config")
    args.config = check_engine_config(p, lambda: engine_config(args), "engine config")
    with refused_as_usage(p):
        SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **sampling_fields(args)).validate(
            args.config.max_new_tokens_limit)
    page = args.config.page_size
    steps = [d for d in args.drafts if d <= args.num_speculative_tokens]
    if steps and args.context < page + max(steps) + 1:  # (regression: negative positions, a traceback)
        p.error(f"--context {args.context} must be at least a page ({page}) + the most drafts ({max(steps)}) + 1")
    return args


def sampling_fields(args) -> dict:
    return {"temperature": args.temperature, "top_p": args.top_p, "repetition_penalty": args.repetition_penalty}


def engine_config(args) -> EngineConfig:
    cuda = args.device == "cuda"
    return EngineConfig(model=args.model, device=args.device, seed=args.seed, page_size=16 if cuda else 4,
                        num_pages=8192 if cuda else 2048, max_running_requests=max(args.batches),
                        dtype=args.dtype, fp32_lm_head=not args.disable_fp32_lm_head, speculative=args.spec)


async def step_ms(engine: Engine, prompts: list[list[int]], drafts: int, repeats: int, device: str,
                  temperature: float = 0.0, top_p: float = 1.0) -> float:
    """Median ms of one step over the cached `prompts` (all in L1): a decode step (drafts 0) or a verify step of
    `drafts` drafts a sequence, launch to tokens on the host; its rows drawn at `temperature`, `top_p` (0: greedy)."""
    binput = BatchInput(is_decode=drafts == 0, verify_drafts=None if drafts == 0 else [])
    for prompt in prompts:
        m = engine.cache.match(prompt)
        cached = m.lengths[0]
        pos = cached - 1 - drafts
        binput.input_ids.extend(prompt[pos:cached])
        binput.prefix_lens.append(pos)
        binput.new_lens.append(drafts + 1)
        binput.page_tables.append(list(m.pages[0]))
        binput.temperatures.append(temperature)
        binput.top_ps.append(top_p)
        binput.generators.append(None)
        if drafts:
            binput.verify_drafts.append(prompt[pos + 1:cached])
    times = []
    for _ in range(repeats + 2):  # two warm-ups
        sync(device)
        t = time.perf_counter()
        await engine.runner.collect(engine.runner.launch(binput))
        times.append(time.perf_counter() - t)
    return median(times[2:]) * 1e3


def greedy_margins(engine: Engine, prompt: list[int]) -> dict:
    """How close greedy decoding is to a tie, over a dense forward of `prompt`: per row, the gap between its two
    largest logits; the share of rows where they are equal, and the median gap against the logits' spread.
    (Where ties are common, any change of rounding, as a verify step's against a decode step's, changes tokens.)"""
    import torch
    with torch.inference_mode():
        logits = engine.model.forward_dense(torch.tensor(prompt, device=engine.device))  # [N, V]
        top = logits.topk(2, dim=-1).values  # [N, 2]
        gap = top[:, 0] - top[:, 1]
        spread = logits.std(dim=-1)
        return {"tied_rows": float((gap == 0).float().mean()), "median_gap_over_std": float((gap / spread).median())}


async def generate(engine: Engine, prompts: list[list[int]], max_tokens: int, device: str,
                   **sampling) -> tuple[float, list]:
    """Seconds and output ids of `prompts` served together; exits 1 naming the error if any request failed."""
    sync(device)
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    results = await engine.generate_async(prompts, params)
    sync(device)
    seconds = time.perf_counter() - t0
    request_errors(results)
    return seconds, [r.output_ids for r in results]


async def main_async(args) -> dict:
    spec = args.spec
    engine = Engine(args.config)
    fields = sampling_fields(args)
    rng = random.Random(args.seed)
    fresh = lambda n: [rng.randrange(1, engine.vocab_size) for _ in range(n)]  # noqa: E731
    try:  # what this engine refuses (L1's pages, the model's positions), before it starts
        engine.validate(fresh(args.prompt_tokens), SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                                                  **fields))
        engine.validate(fresh(args.context), SamplingParams(max_tokens=1))
    except ValueError as exc:
        fail(str(exc))
    speculator = engine.speculator
    await engine.start()
    steps = []
    for b in args.batches:
        prompts = [fresh(args.context) for _ in range(b)]
        request_errors(await engine.generate_async(prompts, SamplingParams(max_tokens=1)))  # (into L1)
        sampling = (args.temperature, args.top_p)
        row = {"batch": b, "decode_ms": await step_ms(engine, prompts, 0, args.repeats, args.device, *sampling)}
        for k in [d for d in args.drafts if d <= spec.num_speculative_tokens]:
            row[f"verify_{k}_ms"] = await step_ms(engine, prompts, k, args.repeats, args.device, *sampling)
        steps.append(row)
    margins = greedy_margins(engine, fresh(args.prompt_tokens))
    runs = []
    await generate(engine, [fresh(args.prompt_tokens)], 8, args.device)  # (warm-up)
    lookup = speculator.draft
    for workload in ("random", "repeat", "again") + (("oracle",) if args.oracle_drafts else ()):
        for b in args.batches:
            timed = {"on": [], "off": []}  # tokens/s of each run: the tokens produced over its seconds
            counts = dict.fromkeys(("accepted_tokens", "draft_tokens", "drafts", "verify_steps", "declined_steps",
                                    "cache_drafts", "cache_accepted_tokens"), 0)
            equal = total = 0
            for rnd in range(args.repeats):
                if workload != "repeat":
                    prompts = [fresh(args.prompt_tokens) for _ in range(b)]
                else:
                    prompts = [(fresh(args.block_tokens) * (args.prompt_tokens // args.block_tokens + 1))
                               [:args.prompt_tokens] for _ in range(b)]
                outputs = {}
                if workload == "again":  # (their first serving, untimed: the answers the cache then holds)
                    await evict(engine, ["l1"])
                    engine.speculator = speculator  # (which keeps their last tokens, past the whole pages)
                    await generate(engine, prompts, args.max_tokens, args.device, **fields)
                # (each run from an empty L1, so neither reuses the other's prompts, but "again"'s, which both
                # reuse; the order alternates by round)
                for mode in ("off", "on") if rnd % 2 == 0 or workload == "oracle" else ("on", "off"):
                    if workload != "again":
                        await evict(engine, ["l1"])
                    engine.speculator = speculator if mode == "on" else None
                    if workload == "oracle" and mode == "on":  # the drafts: what the plain run gave
                        plain = {tuple(p): out for p, out in zip(prompts, outputs["off"])}
                        speculator.draft = lambda req, k, plain=plain: plain[tuple(req.prompt)][
                            len(req.output):len(req.output) + k]
                    before = dict(speculator.stats)
                    seconds, outputs[mode] = await generate(engine, prompts, args.max_tokens, args.device,
                                                            **fields)
                    timed[mode].append(sum(map(len, outputs[mode])) / seconds)
                    if mode == "on":
                        for key in counts:
                            counts[key] += speculator.stats[key] - before[key]
                    speculator.draft = lookup
                equal += sum(a == b_ for a, b_ in zip(outputs["on"], outputs["off"]))
                total += b
            runs.append({"workload": workload, "batch": b, "tok_s_off": median(timed["off"]),
                         "tok_s_on": median(timed["on"]), **counts, "outputs_equal": f"{equal}/{total}"})
    engine.speculator = speculator
    integrity = integrity_of(engine)
    await engine.shutdown()
    return {"model": args.model, "device": args.device, "speculative": vars(spec), "context": args.context,
            "verify_rows": verify_rows(spec.num_speculative_tokens),
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "repetition_penalty": args.repetition_penalty, "steps": steps, "runs": runs,
            "greedy_margins": margins,
            "integrity": integrity}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = asyncio.run(main_async(args))
    dest = sys.stderr if args.json else sys.stdout
    keys = [k for k in out["steps"][0] if k.startswith("verify_")]
    head = ["batch", "decode ms"] + [f"verify k={k.split('_')[1]} ms" for k in keys]
    print(f"step cost over {out['context']} cached tokens (verify graphs of {out['verify_rows']} rows a sequence):",
          file=dest)
    print(table(head, [[str(r["batch"]), fmt(r["decode_ms"])] + [f"{fmt(r[k])} ({r[k] / r['decode_ms']:.2f}x)"
                                                                 for k in keys] for r in out["steps"]]), file=dest)
    head = ["workload", "batch", "tok/s off", "tok/s on", "speedup", "accepted / drafted", "verify steps",
            "declined", "from cache", "tokens a draft", "outputs equal"]
    body = [[r["workload"], str(r["batch"]), fmt(r["tok_s_off"], "{:.1f}"), fmt(r["tok_s_on"], "{:.1f}"),
             fmt(r["tok_s_on"] / r["tok_s_off"], "{:.2f}x"), f"{r['accepted_tokens']} / {r['draft_tokens']}",
             str(r["verify_steps"]), str(r["declined_steps"]), str(r["cache_drafts"]), fmt(r["accepted_tokens"] / r["drafts"] + 1 if r["drafts"] else None),
             r["outputs_equal"]] for r in out["runs"]]
    how = ("greedy" if not out["temperature"] else f"temperature {out['temperature']}, top_p {out['top_p']}") + \
        (f", repetition_penalty {out['repetition_penalty']}" if out["repetition_penalty"] != 1.0 else "") + \
        f", draft_policy {out['speculative']['draft_policy']}"
    print(f"decode ({how}), {out['max_tokens']} tokens a request after {out['prompt_tokens']} prompt tokens:",
          file=dest)
    print(table(head, body), file=dest)
    m = out["greedy_margins"]
    print(f"greedy margins over a prompt: top-2 logits tied in {m['tied_rows']:.1%} of rows, median gap "
          f"{m['median_gap_over_std']:.3f} std", file=dest)
    print(f"integrity: {out['integrity']}", file=dest)
    write_result(out, args.out, args.json)
    return 0 if out["integrity"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())

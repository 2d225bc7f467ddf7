"""What structured outputs' masks cost the host per decode step (scheduler/guided.py): R guided rows' masks
filled at once (`fill_masks`, llguidance's threads), each row then advanced by a token its mask allows (drawn
at random, seeded), for a tokenizer and a grammar; the median step over --steps. No model, no GPU.

    python scripts/probe_guided_masks.py --tokenizer /tmp/bpe151k --rows 1,8,32     (scripts/make_bpe_tokenizer.py)
    python scripts/probe_guided_masks.py --rows 1,32                                (the presets' byte tokenizer)

Grammars: "text" (the regex [a-z ]+, bench_engine.py's), "json" (a tool call's arguments: an object of a
string, a number and an enum), "calls" (tool_choice "required"'s list of calls of two tools). A row whose
grammar completes starts over, so every step fills R masks.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cli import choice_list, fail, int_list, positive_int, refused_as_usage  # noqa: E402
from scheduler.api_tools import ToolFields  # noqa: E402
from scheduler.guided import Guides, GuidedSpec, fill_masks  # noqa: E402
from scheduler.tokenizer import HFTokenizer  # noqa: E402

ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": ARGS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}}, "required": ["zone"]}}}]


GRAMMARS = ("text", "json", "calls")
WARMUP_STEPS = 5  # the first steps of each grammar and row count, left out of the median
QWEN3_VOCAB = 151936
BYTE_VOCAB = 512  # the presets' byte tokenizer's (the tiny preset's vocabulary)


def specs() -> dict[str, GuidedSpec]:
    calls = ToolFields.model_validate({"tools": TOOLS, "tool_choice": "required"}).tool_spec()
    return {"text": GuidedSpec("regex", "[a-z ]+"), "json": GuidedSpec("json_schema", json.dumps(ARGS)),
            "calls": calls}


def step_times_us(guides: Guides, spec: GuidedSpec, rows: int, steps: int, rng: random.Random) -> list[float]:
    live = [guides.start(spec) for _ in range(rows)]
    masks = torch.zeros(rows, guides.words, dtype=torch.int32)
    bits = torch.arange(32, dtype=torch.int32)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fill_masks(live, masks, [()] * rows)
        times.append((time.perf_counter() - t) * 1e6)
        allowed = ((masks.unsqueeze(-1) >> bits) & 1).reshape(rows, -1)[:, :guides.vocab_size]  # [R, V]
        for i, g in enumerate(live):
            ids = allowed[i].nonzero().flatten().tolist()
            ids = [t for t in ids if t not in guides.eos_ids] or ids
            if not ids or g.accept(rng.choice(ids)) is not None or g.complete:
                live[i] = guides.start(spec)  # (whole, or stuck: start over)
    return times


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None, help="a directory with tokenizer.json (default: the byte tokenizer)")
    ap.add_argument("--vocab-size", type=positive_int, default=None,
                    help=f"the model's vocabulary, the masks' width, with --tokenizer: at least the tokenizer's "
                         f"(default: Qwen3's {QWEN3_VOCAB:,}); without --tokenizer refused: the byte tokenizer's "
                         f"masks are the tiny preset's {BYTE_VOCAB} ids wide (a wider mask of 256 bytes is no "
                         f"larger vocabulary's cost)")
    ap.add_argument("--rows", type=int_list(1), default=[1, 8, 32], help="comma list of guided rows a step")
    ap.add_argument("--steps", type=positive_int, default=60,
                    help=f"steps timed per grammar and row count, more than {WARMUP_STEPS}: the first "
                         f"{WARMUP_STEPS} are warm-up, left out of the median (default 60)")
    ap.add_argument("--grammars", type=choice_list(GRAMMARS), default=list(GRAMMARS),
                    help=f"comma list of {', '.join(GRAMMARS)} (default: all)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.steps <= WARMUP_STEPS:  # (regression: the median of no step, a StatisticsError)
        ap.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps left out of the median, got {args.steps}")
    args.tok = None
    if args.tokenizer is None:
        if args.vocab_size is not None:  # (regression: ignored, the masks 512 ids wide)
            ap.error(f"--vocab-size needs --tokenizer (the byte tokenizer's masks are {BYTE_VOCAB} ids wide)")
        return args
    with refused_as_usage(ap, "--tokenizer"):
        args.tok = HFTokenizer(args.tokenizer)
    least = args.tok.tok.get_vocab_size()
    args.vocab_size = args.vocab_size or max(QWEN3_VOCAB, least)
    if args.vocab_size < least:
        ap.error(f"--vocab-size {args.vocab_size} is below the tokenizer's {least} tokens")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tok = args.tok
    eos = () if tok is None else tuple(t for t in (tok.tok.token_to_id("<|im_end|>"),) if t is not None)
    guides = Guides("tiny" if tok is None else args.tokenizer, args.vocab_size if tok else BYTE_VOCAB, eos)
    if tok is not None:
        guides.use(tok)
    t = time.perf_counter()
    guides.warm()
    out = {"tokenizer": args.tokenizer or "bytes", "vocab_size": guides.vocab_size,
           "warm_s": round(time.perf_counter() - t, 2), "cpus": os.cpu_count(), "median_step_us": {}}
    rng = random.Random(0)
    for name in args.grammars:
        spec = specs()[name]
        try:
            guides.check(spec)
        except ValueError as exc:  # (no llguidance, a tokenizer it cannot read: its RequestError)
            fail(f"{name}: {exc}")
        for rows in args.rows:
            times = step_times_us(guides, spec, rows, args.steps, rng)[WARMUP_STEPS:]
            out["median_step_us"][f"{name}_r{rows}"] = round(statistics.median(times), 1)
    if args.json:
        print(json.dumps(out))
        return
    print(f"tokenizer {out['tokenizer']} (vocab {out['vocab_size']}), warm-up {out['warm_s']} s, {out['cpus']} CPUs")
    for key, us in out["median_step_us"].items():
        print(f"  {key:>10}: {us:9.1f} us a step")


if __name__ == "__main__":
    main()

"""Session 75's feature-combination fuzz (in process): random batches of requests, each with a random set of
features (guided, penalties, logit_bias, min_tokens, bans, allowed ids, stop ids, logprobs, prompt_logprobs,
max_tokens 1, seeds, top_k 1, priority, aborts), through an engine with random speculation, hicache tiers, a small
L1 (preemption), chunked prefill, shared prefill; each compared with the same request run alone on a plain
engine (no cache, no speculation)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import sys

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.request import RequestError, SamplingParams
from scheduler.speculative import SpeculativeConfig
from scheduler.tokenizer import ByteTokenizer

VOCAB = 512
PRESSURE = bool(os.environ.get("PRESSURE"))
PREEMPTED: list = []
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "kind": {"enum": ["cat", "dog"]}},
          "required": ["n", "kind"], "additionalProperties": False}
GUIDES = [GuidedSpec("regex", "[a-z ]{5,40}"), GuidedSpec("json_schema", json.dumps(SCHEMA)),
          GuidedSpec("choice", json.dumps(["alpha beta gamma", "alpha beta delta", "omega"])),
          GuidedSpec("regex", "(ab|cd)+x")]
TEXTS = ["abc abc abc abc ", "The cat and the dog and the cat ", "Answer: ", "1 2 3 4 5 6 7 8 9 ",
         "hello world hello world hello "]
TOK = ByteTokenizer(VOCAB)


def draw_params(rng: random.Random, prompt: list[int], priority_on: bool,
                pressure: bool = False) -> tuple[SamplingParams, dict]:
    kw: dict = {"max_tokens": rng.choice([1, 1, 2, 5, 8, 12, 20] if not pressure else [8, 20, 30, 40])}
    info = {}
    r = rng.random()
    if r < 0.2:
        kw.update(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(1000))
    elif r < 0.3:
        kw.update(temperature=0.8, top_k=1)  # forced greedy, unseeded
    if rng.random() < 0.2:
        kw["guided"] = rng.choice(GUIDES)
    if rng.random() < 0.25:
        kw.update(presence_penalty=rng.choice([0.5, -1.0, 1.5]), frequency_penalty=rng.choice([0.0, 0.7]),
                  repetition_penalty=rng.choice([1.0, 1.3, 0.8]))
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.choice([-100.0, 5.0, 100.0, -3.0]) for _ in range(3)}
        if rng.random() < 0.5:
            kw["logit_bias"][rng.choice(prompt)] = rng.choice([10.0, -100.0])
    if rng.random() < 0.2:
        kw["stop_token_ids"] = tuple(rng.sample(prompt, min(2, len(prompt))))
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randrange(0, kw["max_tokens"] + 1)
    if rng.random() < 0.15:
        words = [(rng.choice(prompt),)]
        if len(prompt) > 2:
            i = rng.randrange(len(prompt) - 1)
            words.append(tuple(prompt[i:i + 2]))
        kw["bad_words_token_ids"] = tuple(words)
    if rng.random() < 0.1 and "guided" not in kw:
        kw["allowed_token_ids"] = tuple(sorted(set(prompt) | {rng.randrange(VOCAB) for _ in range(5)}))
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 1, 3])
    if rng.random() < 0.15:
        kw["prompt_logprobs"] = rng.choice([0, 2])
        if rng.random() < 0.3:
            kw["max_tokens"] = 0
            kw.pop("min_tokens", None)
    if rng.random() < 0.2:
        kw["ignore_eos"] = True
    if priority_on and rng.random() < 0.5:
        kw["priority"] = rng.randrange(-3, 4)
    if rng.random() < 0.1:
        info["abort_after"] = rng.randrange(0, 4)
    return SamplingParams(**kw), info


def draw_prompts(rng: random.Random, n: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        base = rng.choice(TEXTS)
        text = base * rng.choice([1, 1, 2]) + "".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(0, 9)))
        if rng.random() < 0.3 and out:
            out.append(list(rng.choice(out)))
            continue
        out.append(TOK.encode(text))
    return out


def draw_engine(rng: random.Random, pressure: bool = False) -> dict:
    cfg = {"page_size": rng.choice([1, 2, 4, 4, 8]), "overlap_schedule": rng.random() < 0.7,
           "max_prefill_tokens": rng.choice([2048, 2048, 7, 16, 33]), "share_prefill": rng.random() < 0.7,
           "scheduling_policy": rng.choice(["fcfs", "priority"]), "max_running_requests": rng.choice([64, 3, 2])}
    cfg["num_pages"] = rng.choice([256, 256, 40, 30]) * 4 // cfg["page_size"]
    if rng.random() < 0.5:
        cfg["decode_reserve_ratio"] = rng.choice([0.3, 0.6, "auto"])
    if pressure:  # (a small L1 that preempts: longer answers, little reserved for decode)
        cfg["num_pages"] = rng.choice([24, 30, 40]) * 4 // cfg["page_size"]
        cfg["decode_reserve_ratio"] = rng.choice([0.1, 0.2])
        cfg["max_running_requests"] = 64
    if rng.random() < 0.6:
        cfg["speculative"] = SpeculativeConfig(num_speculative_tokens=rng.choice([2, 4, 7]), prompt_lookup_max=3,
                                               prompt_lookup_min=1, draft_policy=rng.choice(["always", "cost"]))
    hic = None
    if rng.random() < 0.6:
        hic = {"enable": True, "policy": "always", "prefetch": rng.random() < 0.5,
               "host_ratio": rng.choice([1.0, 2.0]), "storage_ratio": rng.choice([2.0, 4.0])}
    return {"cfg": cfg, "hic": hic}


def make_engine(spec: dict) -> Engine:
    c = EngineConfig(model="tiny", device="cpu", dtype="float32", **spec["cfg"])
    if spec["hic"]:
        c = c.with_hicache(**spec["hic"])
    return Engine(c)


_REF: dict = {}
_REF_ENGINE: list = []


def ref_engine() -> Engine:
    if not _REF_ENGINE:
        _REF_ENGINE.append(Engine(EngineConfig(model="tiny", device="cpu", dtype="float32", page_size=4,
                                               num_pages=1024, enable_prefix_cache=False)))
    return _REF_ENGINE[0]


async def reference(prompt: list[int], p: SamplingParams):
    p = dataclasses.replace(p, priority=0)
    key = (tuple(prompt), repr(p))
    if key not in _REF:
        _REF[key] = (await ref_engine().generate_async([prompt], [p]))[0]
    return _REF[key]


def close_lps(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is None or y is None:
            if x is not y:
                return False
            continue
        if not math.isclose(x.logprob, y.logprob, abs_tol=1e-3) or len(x.top) != len(y.top):
            return False
        if any(not math.isclose(u[1], v[1], abs_tol=1e-3) for u, v in zip(x.top, y.top)):
            return False
    return True


async def collect(eng: Engine, req, abort_after):
    n = 0
    while True:
        ev = await req.queue.get()
        if ev.token_id is not None:
            n += 1
        if ev.finished:
            break
        if abort_after is not None and n >= abort_after:
            await eng.abort(req.rid)
            abort_after = None
    if req.preemptions:
        PREEMPTED.append(req.params)
    return req.result()


async def run_case(seed: int, pressure: bool = PRESSURE) -> list[str]:
    rng = random.Random(seed)
    espec = draw_engine(rng, pressure)
    eng = make_engine(espec)
    problems = []
    try:
        await eng.start()
        for rnd in range(rng.choice([1, 2, 3])):
            prompts = draw_prompts(rng, rng.randrange(1, 9))
            drawn = [draw_params(rng, p, espec["cfg"]["scheduling_policy"] == "priority", pressure) for p in prompts]
            tasks, meta = [], []
            for prompt, (p, info) in zip(prompts, drawn):
                try:
                    req = eng.add_request(prompt, p)
                except RequestError as exc:
                    ref = await reference(prompt, p)
                    if ref.error is None and "L1 pool" not in str(exc):  # (a smaller pool than the reference's)
                        problems.append(f"refused {exc} but reference ran: {p}")
                    continue
                tasks.append(asyncio.ensure_future(collect(eng, req, info.get("abort_after"))))
                meta.append((prompt, p, info))
            try:
                results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            except asyncio.TimeoutError:
                problems.append(f"round {rnd}: hang; engine {espec}")
                return problems
            for (prompt, p, info), got in zip(meta, results):
                want = await reference(prompt, p)
                where = f"round {rnd} prompt {TOK.decode(prompt)!r} params {p} info {info}"
                if p.temperature > 0 and p.seed is None and p.top_k != 1:
                    continue
                if got.finish_reason == "abort" or "abort_after" in info:
                    if got.output_ids != want.output_ids[:len(got.output_ids)] and got.finish_reason == "abort":
                        problems.append(f"{where}: aborted output {got.output_ids} not a prefix of {want.output_ids}")
                    if got.finish_reason == "abort":
                        continue
                if got.error != want.error and (got.error is None or want.error is None):
                    problems.append(f"{where}: error {got.error!r} want {want.error!r}")
                    continue
                if got.output_ids != want.output_ids or got.finish_reason != want.finish_reason:
                    problems.append(f"{where}: got {got.output_ids} {got.finish_reason} want {want.output_ids} "
                                    f"{want.finish_reason}")
                    continue
                if not close_lps(got.logprobs, want.logprobs):
                    problems.append(f"{where}: logprobs differ {got.logprobs} vs {want.logprobs}")
                if not close_lps(got.prompt_logprobs, want.prompt_logprobs):
                    problems.append(f"{where}: prompt logprobs differ")
            eng.check_integrity()
    except Exception as exc:  # noqa: BLE001
        import traceback
        problems.append("exception " + "".join(traceback.format_exception(exc)))
    finally:
        try:
            await eng.shutdown()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"shutdown raised {exc!r}")
    if problems:
        problems.insert(0, f"engine {espec}")
    return problems


def run_seeds(run_case, argv: list[str]) -> int:
    """`python tests/<fuzz>.py FIRST LAST`: run_case over seeds FIRST..LAST, each case's problems printed; the
    failed count returned (the three fuzzes of this session share it)."""
    import traceback

    import conftest  # noqa: F401
    import uvloop

    bad = 0
    for s in range(int(argv[1]), int(argv[2]) + 1):
        try:
            probs = uvloop.run(run_case(s))
        except Exception as exc:  # noqa: BLE001  (a case that raised: printed as its problem)
            probs = ["exception " + "".join(traceback.format_exception(exc))[-3000:]]
        bad += bool(probs)
        print(("FAIL " if probs else "ok   ") + str(s), flush=True)
        for p in probs[:6]:
            print("    " + p[:3000], flush=True)
    return bad


if __name__ == "__main__":
    bad = run_seeds(run_case, sys.argv)
    counts = {name: sum(bool(test(p)) for p in PREEMPTED) for name, test in (
        ("guided", lambda p: p.guided), ("seeded", lambda p: p.seed is not None),
        ("logprobs", lambda p: p.logprobs is not None), ("penalized", lambda p: p.presence_penalty),
        ("bans", lambda p: p.bad_words_token_ids), ("min_tokens", lambda p: p.min_tokens),
        ("prompt_logprobs", lambda p: p.prompt_logprobs is not None))}
    print(f"{bad} failed; {len(PREEMPTED)} requests preempted: {counts}")

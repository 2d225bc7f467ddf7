"""The HTTP differential fuzz's requests with `n` choices, token logprobs, penalties, logit_bias and min_tokens
(tests/test_http_diff_fuzz_hunt.py): drawing their fields (tests/http_fuzz_cases.py) and checking what
the server answered for them (tests/http_fuzz_run.py) against the no-cache reference engine's.

A request's choice j of prompt p is index p * n + j; with a seed it samples with seed + j (wrapped in
64 bits), so the reference runs it as an n=1 request with that seed. Logprobs are asked of the reference
with the same k, and the answer's are compared with them (1e-4) and checked for shape: one entry per
token id, each top-k sorted and <= 0, a completion's text_offset the running sum of its pieces' lengths.
Penalties, logit_bias and min_tokens: the reference runs the same ones (its tokens are the check); a bias
names ids the model picks unbiased (its probe's output), random ones and the prompt's, at values across
[-100, 100]; bias and min_tokens on their own random stream (a seed's other draws stay what they were).
top_k and min_p (scheduler/sampler_fields.py): on greedy requests (ignored) and seeded sampled ones, at values
across their ranges (neutral ones, the vocabulary's size and past it); some sampled requests are forced greedy
(top_k 1 or min_p 1; some of them unseeded, their tokens then known too): the reference also runs each of those
at temperature 0, and its tokens and logprobs must be the same (`forced_greedy`: an oracle beside the diff)."""
from __future__ import annotations

import dataclasses
import math

from scheduler.request import SEED_MAX
from scheduler.tokenizer import decode_completion

LOGPROB_TOL = 1e-4
LOWEST_LOGPROB = -9999.0  # (scheduler/logprobs.py: what a -inf is answered as)
# (name, values a request may carry; None: null, the neutral value)
PENALTY_VALUES = (("presence_penalty", (-2, -1.0, -0.3, 0, 0.5, 1.5, 2.0, None)),
                  ("frequency_penalty", (-2.0, -0.7, 0.0, 0.4, 1, 2, None)),
                  ("repetition_penalty", (0.5, 0.9, 1, 1.3, 2.0, 10, None)))
NEUTRAL_PENALTIES = (0.0, 0.0, 1.0)
INVALID_VALUES = (("n", 0), ("n", True), ("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("logprobs", 1.5),
                  ("presence_penalty", -2.5), ("frequency_penalty", "1"), ("repetition_penalty", 0),
                  ("repetition_penalty", 10.5), ("frequency_penalty", True))


# -- drawing ---------------------------------------------------------------------------------------------
def draw_penalties(rng, body: dict) -> tuple[float, float, float]:
    """(presence, frequency, repetition) of a request: most carry none, some one or more (null or the
    neutral value included)."""
    pen = list(NEUTRAL_PENALTIES)
    if rng.random() < 0.3:
        for i, (name, values) in enumerate(PENALTY_VALUES):
            if rng.random() < 0.5:
                body[name] = rng.choice(values)
                if body[name] is not None:
                    pen[i] = float(body[name])
    return tuple(pen)


BIAS_VALUES = (-100, -100.0, 100, -5, -0.5, 0, 0.5, 5.0)
INVALID_BIASES = ({"-1": 1}, {"1": 100.5}, {"x": 1}, {"05": 1}, {"1": "1"}, {"1": True}, {"512": 0})


def draw_logit_bias(rng, body: dict, prompts: list[list[int]], likely: list[list[int]]) -> dict[int, float] | None:
    """SamplingParams.logit_bias of a request (the body's: ids as strings): most carry none; some ids
    each prompt's probe output holds (`likely`: what the model picks unbiased), random ones, a prompt's."""
    if rng.random() >= 0.3:
        return None
    bias: dict[int, float] = {}

    def value() -> float:
        return rng.choice(BIAS_VALUES) if rng.random() < 0.8 else round(rng.uniform(-100, 100), 3)
    for out in likely:
        for _ in range(rng.choice([0, 1, 1, 2]) if out else 0):
            bias[rng.choice(out[:rng.randrange(1, len(out) + 1)])] = value()
    for _ in range(rng.choice([0, 0, 1, 3, 30])):
        bias[rng.randrange(512)] = value()
    if rng.random() < 0.2 and prompts[0]:
        bias[rng.choice(prompts[0])] = value()
    bias = bias or {rng.randrange(512): value()}
    body["logit_bias"] = {str(t): v for t, v in bias.items()}
    return {t: float(v) for t, v in bias.items()}


def draw_min_tokens(rng, body: dict, max_tokens: int, stop_strings: bool) -> int:
    """vLLM's min_tokens (its stop ids and EOS held back for the first min_tokens tokens: a penalty
    state's row for those steps only), on some requests without stop strings (the expected text here
    does not follow min_tokens' rule for those: tests/test_min_tokens.py does)."""
    if stop_strings or rng.random() >= 0.2 or max_tokens < 1:  # (a max_tokens below 1: a 400 for that)
        return 0
    body["min_tokens"] = rng.randrange(0, max_tokens + 1)
    return body["min_tokens"]


TOP_K_VALUES = (-1, 0, 1, 2, 5, 40, None)  # (and the vocabulary's size less one, it, past it)
MIN_P_VALUES = (0, 0.0, 1e-9, 0.02, 0.1, 0.3, 0.9, 1, 1.0, None)
INVALID_SAMPLER_VALUES = (("top_k", -2), ("top_k", 1.5), ("top_k", "3"), ("top_k", True), ("min_p", 1.5),
                          ("min_p", -0.1), ("min_p", "0.1"), ("min_p", False))


def draw_top_k_min_p(rng, body: dict, sampled: bool, vocab: int) -> tuple[int, float]:
    """SamplingParams' (top_k, min_p) of a request as the server makes them of its body's (left out or null: 0;
    -1 kept): most carry neither; some one or both; some sampled ones are forced greedy (top_k 1 or min_p 1,
    beside any other value), half of those with their seed taken out of the body (their tokens are known)."""
    if rng.random() >= 0.4:
        return 0, 0.0
    top_ks = TOP_K_VALUES + (vocab - 1, vocab, vocab + 88)
    forced = sampled and rng.random() < 0.4
    if forced:
        other_k, other_p = rng.choice(top_ks), rng.choice(MIN_P_VALUES)
        fields = rng.choice([{"top_k": 1}, {"min_p": 1}, {"min_p": 1.0}, {"top_k": 1, "min_p": other_p},
                             {"min_p": 1.0, "top_k": other_k}])
    else:
        fields = {"top_k": rng.choice(top_ks)} if rng.random() < 0.6 else {}
        if rng.random() < 0.6 or not fields:
            fields["min_p"] = rng.choice(MIN_P_VALUES)
    body.update(fields)
    if forced and rng.random() < 0.5:
        body.pop("seed")
    return fields.get("top_k") or 0, float(fields.get("min_p") or 0.0)


def forced_greedy(params) -> bool:
    """Sampled, with only the likeliest token left to draw: the greedy tokens (ties aside: the tiny model has none)."""
    return params is not None and not params.greedy and (params.top_k == 1 or params.min_p == 1.0)


def draw_n(rng, body: dict) -> int:
    if rng.random() < 0.25:
        body["n"] = rng.choice([2, 2, 3, 4])
        return body["n"]
    return 1


def draw_logprobs(rng, body: dict, chat: bool) -> int | None:
    """The k of SamplingParams.logprobs the body asks for (completions: `logprobs: k`; chat: `logprobs:
    true` and `top_logprobs`, 0 when left out)."""
    if rng.random() > (0.5 if chat else 0.3):
        return None
    k = rng.choice([0, 0, 1, 3, 5, 20])
    if chat:
        body["logprobs"] = True
        if k or rng.random() < 0.5:
            body["top_logprobs"] = k
    else:
        body["logprobs"] = k
    return k


def choice_params(params, j: int):
    """Choice j's SamplingParams: the request's, with seed + j (wrapped within a seed's 64 bits)."""
    if params.seed is None or j == 0:
        return params
    seed = params.seed + j
    return dataclasses.replace(params, seed=seed - (1 << 64) if seed > SEED_MAX else seed)


# -- the reference's logprobs -----------------------------------------------------------------------------
def piece(tok, token_id: int) -> str:
    """A token's text as the API names it: decoded alone, or "token_id:N" where that is empty."""
    text = tok.decode([token_id]) if tok is not None else ""
    return text or f"token_id:{token_id}"


def reference_entries(tok, ids: list[int], lps: list) -> list[tuple]:
    """Per generated token: (its piece, its logprob, [(piece, logprob)] of the k likeliest), the
    reference engine's, with -inf as the API clamps it."""
    def clamp(v: float) -> float:
        return v if v >= LOWEST_LOGPROB else LOWEST_LOGPROB
    return [(piece(tok, t), clamp(lp.logprob), [(piece(tok, a), clamp(v)) for a, v in lp.top])
            for t, lp in zip(ids, lps)]


def apply_stops(tok, context: list[int], ids: list[int], finish: str, stops: tuple) -> tuple:
    """What the API answers for generated `ids` (`finish`: the engine's reason): a stop token's text
    (an engine "stop") is left out; the first stop string seen in the text so far (a character counts
    once whole) ends it there, with the tokens up to the one that completed it."""
    shown = ids[:-1] if finish == "stop" else ids
    for k in range(1, len(shown) + 1) if stops else ():
        text = decode_completion(tok, context, shown[:k]).rstrip("\ufffd")
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], list(ids[:k]), "stop"
    return decode_completion(tok, context, shown), list(ids), finish


# -- checking an answer ------------------------------------------------------------------------------------
def merge_logprobs(acc: dict | None, chunk_lp: dict | None) -> dict | None:
    """A stream's logprobs of one choice so far, with one chunk's added (their lists run on)."""
    if chunk_lp is None:
        return acc
    if acc is None:
        return {k: list(v) for k, v in chunk_lp.items()}
    for key, values in chunk_lp.items():
        acc.setdefault(key, []).extend(values)
    return acc


def _close(a: float, b: float) -> bool:
    return isinstance(a, (int, float)) and math.isclose(a, b, abs_tol=LOGPROB_TOL)


def _compare_top(got: list[tuple[str, float]], want: list[tuple[str, float]], where: str) -> list[str]:
    """Two (piece, logprob) lists, likeliest first: the same length and values; a piece may differ only
    where logprobs tie (within the tolerance), as the two engines' rounding may order them."""
    if len(got) != len(want):
        return [f"{where}: {len(got)} alternatives, want {len(want)}: {got} vs {want}"]
    want_by_piece = {p: v for p, v in reversed(want)}
    boundary = want[-1][1] if want else 0.0
    for (gp, gv), (wp, wv) in zip(got, want):
        if not _close(gv, wv):
            return [f"{where}: alternatives {got}, want {want}"]
        if gp != wp and not (gp in want_by_piece and _close(want_by_piece[gp], gv)) and not _close(gv, boundary):
            return [f"{where}: alternatives {got}, want {want}"]
    return []


def check_logprobs(chat: bool, k: int | None, got: dict | None, ids: list[int], want: list | None,
                   complete: bool) -> list[str]:
    """One choice's answered logprobs (`got`, a stream's merged) for its token `ids`: null when not asked,
    else the shape of its endpoint, one entry per token, each like the reference's entry (`want`, for
    the expected ids: an incomplete answer is a prefix of it)."""
    if k is None:
        return [] if got is None else [f"logprobs {str(got)[:200]} not asked for"]
    if got is None:
        return [] if not ids else ["no logprobs"]
    out: list[str] = []
    if chat:
        content = got.get("content")
        if set(got) != {"content"} or not isinstance(content, list):
            return [f"a chat's logprobs {str(got)[:200]}"]
        entries = []
        for e in content:
            if set(e) != {"token", "logprob", "bytes", "top_logprobs"} or e["bytes"] != list(e["token"].encode()) \
                    or any(t["bytes"] != list(t["token"].encode()) for t in e["top_logprobs"]):
                return [f"a chat logprobs entry {e}"]
            entries.append((e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]]))
    else:
        if set(got) != {"tokens", "token_logprobs", "top_logprobs", "text_offset"}:
            return [f"a completion's logprobs {str(got)[:200]}"]
        cols = [got["tokens"], got["token_logprobs"], got["top_logprobs"], got["text_offset"]]
        if len({len(c) for c in cols}) != 1:
            return [f"logprobs columns of lengths {[len(c) for c in cols]}"]
        offsets = got["text_offset"]
        running = [sum(len(p) for p in got["tokens"][:i]) for i in range(len(offsets))]
        if offsets != running:
            out.append(f"text_offset {offsets}, want {running} (the pieces' lengths run on)")
        entries = [(p, v, list(top.items())) for p, v, top in zip(*cols[:3])]
    if len(entries) != len(ids):
        return out + [f"{len(entries)} logprobs entries for {len(ids)} tokens"]
    for i, (p, v, top) in enumerate(entries):
        values = [tv for _, tv in top]
        # (a completion's dict: the sampled token's last where it is not one of the k; pieces alike share one)
        ranked = values[:-1] if not chat and top and top[-1][0] == p else values
        # (`_close(v, v)`: a number, not NaN)
        if not _close(v, v) or v > 0 or any(tv > 0 for tv in values) or ranked != sorted(ranked, reverse=True):
            out.append(f"token {i}: logprob {v}, alternatives {top} (each <= 0, likeliest first)")
        if chat and len(top) != k:
            out.append(f"token {i}: {len(top)} top_logprobs, asked for {k}")
    if want is None:
        return out
    want = want[:len(entries)] if not complete else want
    if len(want) != len(entries):
        return out + [f"{len(entries)} logprobs entries, the reference has {len(want)}"]
    for i, ((p, v, top), (wp, wv, wtop)) in enumerate(zip(entries, want)):
        if p != wp or not _close(v, wv):
            out.append(f"token {i}: {p!r} {v}, the reference's {wp!r} {wv}")
        if not chat:  # the k likeliest, then the sampled token's where it is not one of them (pieces alike: one)
            merged: dict = {}
            for tp, tv in [*wtop, (wp, wv)]:
                merged.setdefault(tp, tv)
            wtop = list(merged.items())
        out += _compare_top(top, wtop, f"token {i}")
        if len(out) > 4:
            break
    return out


def forced_greedy_problems(key: tuple, forced, greedy) -> list[str]:
    """A forced-greedy request's result against its temperature-0 twin's: the same tokens, finish_reason and
    logprobs (the raw logits', whatever top_k or min_p)."""
    where = f"prompt {len(key[0])} tokens, {key[1]}"
    if (forced.output_ids, forced.finish_reason) != (greedy.output_ids, greedy.finish_reason):
        return [f"forced greedy {forced.finish_reason} {forced.output_ids} != temperature 0's "
                f"{greedy.finish_reason} {greedy.output_ids}; {where}"]
    for n, (a, b) in enumerate(zip(forced.logprobs or [], greedy.logprobs or [])):
        if [t for t, _ in a.top] != [t for t, _ in b.top] or any(
                abs(x - y) > LOGPROB_TOL for x, y in zip([a.logprob, *(v for _, v in a.top)],
                                                         [b.logprob, *(v for _, v in b.top)])):
            return [f"forced greedy token {n}: logprobs {a} != temperature 0's {b}; {where}"]
    return []


def prompt_count(choices: list) -> int:
    return sum(1 for c in choices if c.j == 0)


def prompt_tokens(choices: list) -> int:
    """Usage's prompt tokens: each prompt's once, whatever its n."""
    return sum(len(c.ids) for c in choices if c.j == 0)


def feature_tags(choice, chat: bool, stream: bool) -> list[str]:
    """What a choice exercised of these features (the hunt prints their counts)."""
    p, how = choice.params, "stream" if stream else "whole"
    if p is None:  # (a hand-made call's choice: its params are not known)
        return []
    tags = [f"choice j>0 {'seeded' if p.seed is not None and not p.greedy else 'greedy'}"] if choice.j else []
    if p.logprobs is not None:
        tags.append(f"logprobs {'chat' if chat else 'completion'} {how}")
    if p.penalized:
        tags.append(f"penalized {'greedy' if p.greedy else 'sampled'}")
    if p.logit_bias:
        tags.append(f"logit_bias {'greedy' if p.greedy else 'sampled'}{' penalized' if p.penalized else ''}")
    if p.min_tokens and (p.stop_token_ids or not p.ignore_eos):
        tags.append("min_tokens")
    if p.top_k or p.min_p:
        tags.append(f"top_k/min_p {'greedy' if p.greedy else 'forced greedy' if forced_greedy(p) else 'sampled'}"
                    f"{' unseeded' if p.seed is None and not p.greedy else ''}")
    return tags

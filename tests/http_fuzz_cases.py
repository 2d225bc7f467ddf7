"""The HTTP differential fuzz's cases (tests/test_http_diff_fuzz_hunt.py): a seed's server
configuration and its rounds of calls, each with what a no-cache Engine answers (built by probing
one), so that stop strings and ids are ones the model will meet."""
from __future__ import annotations

import copy
import dataclasses
import random
from dataclasses import dataclass, field

from http_fuzz_features import (INVALID_BIASES, INVALID_SAMPLER_VALUES, INVALID_VALUES, apply_stops, choice_params,
                                draw_logit_bias, draw_logprobs, draw_min_tokens, draw_n, draw_penalties,
                                draw_top_k_min_p, forced_greedy, forced_greedy_problems, reference_entries)
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from scheduler.tokenizer import ByteTokenizer, HFTokenizer, decode_completion

VOCAB = 512
PROBE_TOKENS = 16      # tokens each prompt is first run for, to pick stop ids and strings that match
ENGINE_MAX_TOKENS = 32  # the engine's max_new_tokens_limit
HANG_GUARD_S = 30.0
TEXT_ALPHABET = "abcdefgh ijk.,<>:é中ü€🙂\n"
_TOKENIZER_DIR: str | None = None


def byte_level_tokenizer_dir() -> str:
    """A byte-level tokenizer.json with a chat template (test_server_text's), written once."""
    global _TOKENIZER_DIR
    if _TOKENIZER_DIR is None:
        import atexit
        import pathlib
        import shutil
        import tempfile

        from test_server_text import _write_byte_level_tokenizer
        path = pathlib.Path(tempfile.mkdtemp(prefix="http_fuzz_tok_"))
        atexit.register(shutil.rmtree, path, True)
        _write_byte_level_tokenizer(path)
        _TOKENIZER_DIR = str(path)
    return _TOKENIZER_DIR


# -- a case: the server, the calls of each round ------------------------------------------------------
@dataclass
class Choice:
    """One choice of a call (choice j of its prompt_index-th prompt): its prompt's ids, the SamplingParams
    the server should make of the body for it, and the decoding context of its text (a chat's answer has none)."""
    ids: list[int]
    params: SamplingParams | None
    chat: bool = False
    expected: tuple | None = None  # (text, token ids, finish_reason)
    prompt_index: int = 0
    j: int = 0
    ref_logprobs: list | None = None  # the reference's per expected token (http_fuzz_features.reference_entries)

    def key(self) -> tuple:
        return (tuple(self.ids), self.params)


@dataclass
class Call:
    path: str
    body: dict
    choices: list[Choice]
    stops: tuple = ()              # stop strings
    status: int = 200              # expected; 4xx: refused (nothing queued)
    disconnect: tuple | None = None
    spec: str = "2.3"
    send_raises: bool = False
    delay_s: float = 0.0

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Case:
    seed: int
    page_size: int
    num_pages: int
    engine: dict
    hicache: dict
    limits: dict
    tokenizer: str                 # "bytes" (the preset's fallback) | "hf" (a tokenizer.json with a chat template)
    eos: tuple = ()
    rounds: int = 2
    # drained: each round ends (idle, checked) before the next; overlapping: every round's calls at once,
    # staggered; shutdown: drained, the last round cut by the server's shutdown (its lifespan's end)
    rounds_mode: str = "drained"
    flushes: list = field(default_factory=list)  # per round: tiers flushed after it
    calls: list = field(default_factory=list)
    seen: dict = field(default_factory=dict)  # what the run exercised (the hunt prints it)
    oracle_problems: list = field(default_factory=list)  # the reference against its forced-greedy twins (`expect`)

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def max_tokens_limit(self) -> int:
        lim = self.limits.get("max_tokens_limit", 0)
        return min(ENGINE_MAX_TOKENS, lim) if lim else ENGINE_MAX_TOKENS

    @property
    def prompt_limit(self) -> int:
        lim = self.limits.get("max_prompt_tokens", 0)
        return min(self.pool_tokens, lim) if lim else self.pool_tokens


def make_tokenizer(kind: str):
    return HFTokenizer(byte_level_tokenizer_dir()) if kind == "hf" else ByteTokenizer(VOCAB)


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(TEXT_ALPHABET) for _ in range(n))


def make_skeleton(seed: int) -> Case:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 4, 8, 16])
    pool_tokens = rng.choice([48, 72, 96, 96, 128])
    engine = {"max_running_requests": rng.choice([1, 2, 4, 8, 32]), "max_prefill_tokens": rng.choice([7, 16, 64, 2048]),
              "overlap_schedule": rng.random() < 0.7, "restore_overlap": rng.random() < 0.7}
    has_l3 = rng.random() < 0.7
    hicache = {"host_ratio": rng.choice([0.5, 1.0, 2.0]), "storage_ratio": rng.choice([1.0, 2.0, 4.0]) if has_l3 else 0.0,
               "write_policy": rng.choice(["write_through", "write_through_selective", "write_back"]),
               "policy": rng.choice(["always", "always", "cost"]), "prefetch": rng.random() < 0.7,
               "transfer_backend": "torch", "io_workers": rng.choice([1, 4])}
    limits = {"shutdown_grace_s": rng.choice([0.0, 0.01, 1.0])}
    if rng.random() < 0.15:  # some calls get a 429 (a batch of more prompts: a 400)
        limits["max_concurrent_requests"] = rng.choice([2, 3, 5])
    if rng.random() < 0.3:
        limits["max_tokens_limit"] = rng.choice([8, 20])
    if rng.random() < 0.2:
        limits["max_prompt_tokens"] = rng.choice([24, 48])
    tokenizer = rng.choice(["bytes", "hf"])
    if has_l3 and rng.random() < 0.25:  # L3 reads slowed: requests park on them while clients come and go
        hicache["faults"] = rng.choice([0.005, 0.03])
    return Case(seed, page_size, pool_tokens // page_size, engine, hicache, limits, tokenizer,
                rounds=rng.choice([2, 2, 3]), rounds_mode=rng.choice(["drained", "drained", "overlapping", "shutdown"]),
                flushes=[rng.choice([(), (), ("l1",), ("l1", "l2")]) for _ in range(3)])


class Builder:
    """Draws a case's calls: prompts over a few shared prefixes, then their parameters, stop ids and
    strings (picked from each prompt's probe output, so that many match)."""

    def __init__(self, case: Case, rng: random.Random) -> None:
        self.case, self.rng = case, rng
        self.bias_rng = random.Random(case.seed * 104729 + 5)  # (logit_bias, min_tokens: their own stream)
        self.sampler_rng = random.Random(case.seed * 104729 + 11)  # (top_k, min_p: theirs)
        self.tok = make_tokenizer(case.tokenizer)
        self.id_bases = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(rng.randrange(1, 4))]
        self.text_bases = [random_text(rng, rng.randrange(2, 30)) for _ in range(rng.randrange(1, 3))]
        self.system = random_text(rng, rng.randrange(4, 24))

    def prompt(self) -> tuple[object, list[int], bool]:
        """(what the body carries, its ids, chat?)."""
        rng = self.rng
        kind = rng.choice(["ids", "ids", "text", "chat"])
        if rng.random() < 0.06:  # long: its max_tokens may reach the L1's capacity (or pass it)
            case = self.case
            n = rng.randrange(case.pool_tokens - case.max_tokens_limit + 1, case.pool_tokens + 2)
            ids = (rng.choice(self.id_bases) * n)[:n]
            return ids, ids, False
        if kind == "ids":
            base = rng.choice(self.id_bases)
            ids = base[:rng.randrange(0, len(base) + 1)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))]
            ids = ids or [rng.randrange(VOCAB)]
            return ids, ids, False
        if kind == "text":
            text = rng.choice(self.text_bases)
            text = text[:rng.randrange(0, len(text) + 1)] + random_text(rng, rng.randrange(0, 8))
            text = text or "x"
            return text, self.tok.encode(text), False
        messages = [{"role": "user", "content": random_text(rng, rng.randrange(1, 12))}]
        if rng.random() < 0.7:
            messages.insert(0, {"role": "system", "content": self.system})
        if rng.random() < 0.3:
            messages[-1:-1] = [{"role": "user", "content": random_text(rng, 3)},
                               {"role": "assistant", "content": random_text(rng, 5)}]
        if self.case.tokenizer != "hf":
            return messages, [], True
        return messages, self.tok.apply_chat_template(messages), True

    def sampling(self, body: dict) -> tuple[float, float, int | None, tuple, int, float]:
        """(temperature, top_p, seed, penalties, top_k, min_p): what the probes and SamplingParams take."""
        rng = self.rng
        mode = rng.choice(["greedy", "greedy", "greedy_seed", "seeded", "seeded_default"])
        temperature, top_p, seed = 0.0, 1.0, None
        if mode == "greedy":
            body["temperature"] = 0 if rng.random() < 0.5 else 0.0
        elif mode == "greedy_seed":
            body["temperature"] = 0.0
            seed = body["seed"] = rng.randrange(1 << 20)
        else:
            seed = body["seed"] = rng.choice([rng.randrange(1 << 20), -5, (1 << 64) - 1])
            if mode == "seeded":
                temperature = body["temperature"] = rng.choice([0.7, 1.0, 1.5])
                if rng.random() < 0.5:
                    top_p = body["top_p"] = rng.choice([0.5, 0.9, 1.0])
            else:  # no temperature: OpenAI's default of 1
                temperature = 1.0
        pen = draw_penalties(rng, body)
        top_k, min_p = draw_top_k_min_p(self.sampler_rng, body, temperature > 0.0, VOCAB)  # (may take its seed out)
        return temperature, top_p, body.get("seed"), pen, top_k, min_p

    def max_tokens(self, body: dict, ids_list: list[list[int]], chat: bool) -> int:
        rng, case = self.rng, self.case
        limit = case.max_tokens_limit
        longest = max((len(i) for i in ids_list), default=1)
        fit = case.pool_tokens - longest + 1
        choice = rng.choice(["small", "small", "small", "one", "limit", "absent", "fit"])
        if fit < limit and rng.random() < 0.5:  # a long prompt: the most tokens the L1 holds, or one more
            choice = "fit"
            fit += rng.choice([0, 0, 1])
        if choice == "absent" and (not chat or fit <= limit):
            if chat:
                return max(1, case.pool_tokens + 1 - longest)
            return min(16, limit)
        mt = {"small": rng.randrange(1, 12), "one": 1, "limit": limit, "fit": min(limit, fit), "absent": limit}[choice]
        body["max_tokens"] = mt
        return mt

    def draft(self) -> tuple:
        """A call's path, body (so far), prompt ids, chat? and sampling: what its probes need."""
        rng = self.rng
        body: dict = {}
        if rng.random() < 0.7:
            body["model"] = rng.choice(["tiny", "", "tiny"])
        first, ids, chat = self.prompt()
        prompts = [(first, ids)]
        if not chat and rng.random() < 0.25:  # a batch: a list of prompts of the same kind
            kind, size = type(first), rng.randrange(2, 4)
            while len(prompts) < size:
                p, i, c = self.prompt()
                if type(p) is kind and not c:
                    prompts.append((p, i))
        if chat:
            path, body["messages"] = "/v1/chat/completions", first
        else:
            path = "/v1/completions"
            if len(prompts) > 1 or rng.random() < 0.1:
                body["prompt"] = [p for p, _ in prompts]
            else:
                body["prompt"] = first
        return path, body, [i for _, i in prompts], chat, self.sampling(body)

    def call(self, draft: tuple, probes: dict) -> Call:
        rng, case = self.rng, self.case
        path, body, ids_list, chat, (temperature, top_p, seed, pen, top_k, min_p) = draft
        mt = self.max_tokens(body, ids_list, chat)
        # stop ids and strings, from the probe outputs where they would match
        stop_ids: list[int] = []
        stops: list[str] = []
        probe_ids = [probes.get((tuple(i), *draft[4]), []) for i in ids_list]
        if rng.random() < 0.3:
            pool = [t for out in probe_ids for t in out[:mt + 2]] or [rng.randrange(VOCAB)]
            stop_ids = [rng.choice(pool) for _ in range(rng.randrange(1, 3))]
            if rng.random() < 0.3:
                stop_ids.append(rng.randrange(VOCAB))
            how = rng.choice(["list", "one", "field"] if len(stop_ids) == 1 else ["list", "field"])
            if how == "one":
                body["stop"] = stop_ids[0]
            elif how == "list":
                body["stop"] = list(stop_ids)
            else:
                body["stop_token_ids"] = list(stop_ids)
        elif rng.random() < 0.6:
            for i, out in zip(ids_list, probe_ids):
                text = decode_completion(self.tok, [] if chat else i, out[:mt]).replace("\ufffd", "")
                if text and len(stops) < 4:
                    a = rng.randrange(len(text))
                    stop = text[a:a + rng.randrange(1, 6)]
                    stops.append(stop)
                    # and a suffix of it that first occurs there too: both complete on the same token,
                    # and the leftmost match must win
                    tails = [stop[j:] for j in range(1, len(stop)) if text.find(stop) == a
                             and text.find(stop[j:]) == a + j]
                    if tails and rng.random() < 0.5:
                        stops.insert(len(stops) - rng.randrange(2), rng.choice(tails))
            if rng.random() < 0.3:
                stops.append(random_text(rng, rng.randrange(1, 3)))
            stops = stops[:4]
            stops = list(dict.fromkeys(stops)) or ["zz"]
            body["stop"] = stops[0] if len(stops) == 1 and rng.random() < 0.5 else stops
            if rng.random() < 0.3:  # and stop token ids beside them
                pool = [t for out in probe_ids for t in out[:mt + 2]] or [rng.randrange(VOCAB)]
                stop_ids = body["stop_token_ids"] = [rng.choice(pool)]
        ignore_eos = False
        if case.eos and rng.random() < 0.3:
            ignore_eos = body["ignore_eos"] = True
        stream = rng.random() < 0.5
        if stream or rng.random() < 0.2:
            body["stream"] = stream
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": rng.random() < 0.7}
        n, logprobs = draw_n(rng, body), draw_logprobs(rng, body, chat)
        neutral = [("n", 1), ("n", None), ("logprobs", None), ("logprobs", False), ("presence_penalty", 0),
                   ("frequency_penalty", 0.0), ("logit_bias", {}), ("user", "u")]
        neutral += [("tools", []), ("tool_choice", "none"), ("response_format", {"type": "text"})] if chat else \
            [("echo", False), ("best_of", 1), ("suffix", None)]
        for name, value in neutral:
            # (best_of 1 beside n > 1 is a 400, OpenAI's and vLLM's: not neutral; drawn still, so seeds stay alike)
            if rng.random() < 0.05 and name not in body and not (name == "best_of" and n > 1):
                body[name] = value
        if chat and "max_tokens" in body and rng.random() < 0.3:  # the newer name
            body["max_completion_tokens"] = body.pop("max_tokens")
        bias = draw_logit_bias(self.bias_rng, body, ids_list, [out[:mt] for out in probe_ids])
        min_tokens = draw_min_tokens(self.bias_rng, body, mt, bool(stops))
        params = SamplingParams(max_tokens=mt, temperature=temperature, top_p=top_p, seed=seed,
                                stop_token_ids=tuple(dict.fromkeys(stop_ids)), ignore_eos=ignore_eos,
                                logprobs=logprobs, presence_penalty=pen[0], frequency_penalty=pen[1],
                                repetition_penalty=pen[2], logit_bias=bias, min_tokens=min_tokens, top_k=top_k,
                                min_p=min_p)
        # choice p * n + j: prompt p, seed + j (OpenAI's order; scheduler/choices.py)
        choices = [Choice(i, choice_params(params, j), chat, prompt_index=p, j=j)
                   for p, i in enumerate(ids_list) for j in range(n)]
        call = Call(path, body, choices, tuple(stops))
        call.status = self.expected_status(call, chat)
        self.client_side(call)
        return call

    def expected_status(self, call: Call, chat: bool) -> int:
        case = self.case
        if chat and case.tokenizer != "hf":
            return 400  # no chat template
        mt = call.choices[0].params.max_tokens
        if not 1 <= mt <= case.max_tokens_limit:
            return 400
        if len(call.choices) > case.limits.get("max_concurrent_requests", 1024):
            return 400
        for c in call.choices:
            if not c.ids or len(c.ids) > case.prompt_limit or len(c.ids) + mt - 1 > case.pool_tokens:
                return 400
        return 200

    def client_side(self, call: Call) -> None:
        rng = self.rng
        call.delay_s = rng.choice([0.0, 0.0, 0.0, rng.uniform(0, 0.02)])
        call.spec = rng.choice(["2.3", "2.3", "2.4"])
        call.send_raises = call.spec == "2.4" and rng.random() < 0.7
        if rng.random() < 0.15:
            call.disconnect = rng.choice([("body",), ("after_s", rng.uniform(0, 0.03)),
                                          ("events", rng.randrange(0, 4)), ("events", 1)])

    def invalid_call(self) -> Call:
        """A request the server must refuse with a 400 (404: a model it does not serve) and queue nothing of."""
        rng, case = self.rng, self.case
        ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10))]
        body: dict = {"prompt": ids, "max_tokens": 4, "temperature": 0}
        body["stream"] = rng.random() < 0.5
        status = 400
        what = rng.choice(["max0", "over_limit", "too_long", "capacity", "bad_id", "empty", "n17", "stop5",
                           "stop_empty", "batch_bad", "neg_stop", "options", "model", "value", "type"])
        if what == "max0":
            body["max_tokens"] = rng.choice([0, -1])
        elif what == "over_limit":
            body["max_tokens"] = case.max_tokens_limit + 1
        elif what == "too_long":
            body["prompt"] = [rng.randrange(VOCAB) for _ in range(case.prompt_limit + 1)]
        elif what == "capacity":  # fits alone, not with its max_tokens
            mt = case.max_tokens_limit
            n = case.pool_tokens - mt + 2
            if n > case.prompt_limit or n < 1:
                body["max_tokens"] = 0
            else:
                body["prompt"], body["max_tokens"] = [rng.randrange(VOCAB) for _ in range(n)], mt
        elif what == "bad_id":
            body["prompt"] = ids + [VOCAB]
        elif what == "empty":
            body["prompt"] = []
        elif what == "n17":  # past N_MAX (n > 1 is served: tests/test_n_choices.py)
            body["n"] = 17
        elif what == "stop5":
            body["stop"] = ["a", "b", "c", "d", "e"]
        elif what == "stop_empty":
            body["stop"] = ["a", ""]
        elif what == "batch_bad":
            body["prompt"] = [ids, [VOCAB + 3]]
        elif what == "neg_stop":
            body["stop"] = [-1]
        elif what == "options":  # stream_options without a stream
            body["stream"], body["stream_options"] = False, {"include_usage": True}
        elif what == "model":
            body["model"], status = "not-served", 404
        elif what == "value":
            if self.bias_rng.random() < 0.3:  # (and a bad logit_bias beside it)
                body["logit_bias"] = dict(self.bias_rng.choice(INVALID_BIASES))
            name, value = rng.choice([("temperature", 101), ("temperature", -0.5), ("top_p", 0), ("top_p", 1.5),
                                      ("seed", 1 << 64), ("presence_penalty", 2.5), ("max_tokens", 0), ("best_of", 2),
                                      *INVALID_VALUES])
            if self.sampler_rng.random() < 0.3:  # (or a bad top_k / min_p)
                name, value = self.sampler_rng.choice(INVALID_SAMPLER_VALUES)
            body[name] = value
        else:  # a JSON type the schema does not coerce
            name, value = rng.choice([("max_tokens", True), ("max_tokens", "4"), ("prompt", 5),
                                      ("stop", [1, "a"]), ("temperature", "0"), ("unknown_field", 1)])
            body[name] = value
        call = Call("/v1/completions", body, [], status=status)
        self.client_side(call)
        call.disconnect = None
        return call


async def build_case(seed: int, probe_engine: Engine, max_calls: int) -> Case:
    """The case's calls: prompts and sampling drawn first, run for PROBE_TOKENS on `probe_engine` (no
    cache, ignoring EOS), then each call's max_tokens, stops and client over those probes. A next turn
    (a single token-id prompt) continues an earlier call's prompt with some of its output, then a tail."""
    case = make_skeleton(seed)
    rng = random.Random(seed * 7919 + 1)
    b = Builder(case, rng)
    kinds = [rng.random() > 0.12 for _ in range(rng.randrange(max(3, max_calls // 2), max_calls + 1))]
    drafts = [b.draft() if valid else None for valid in kinds]
    probes: dict = {}

    async def probe() -> None:
        keys = list(dict.fromkeys((tuple(ids), *d[4]) for d in drafts if d is not None for ids in d[2] if ids))
        keys = [k for k in keys if k not in probes]
        params = [SamplingParams(max_tokens=PROBE_TOKENS, temperature=k[1], top_p=k[2], seed=k[3], ignore_eos=True,
                                 presence_penalty=k[4][0], frequency_penalty=k[4][1], repetition_penalty=k[4][2],
                                 top_k=k[5], min_p=k[6])
                  for k in keys]
        probes.update(zip(keys, await run_reference(probe_engine, list(zip([list(k[0]) for k in keys], params)))))

    await probe()
    for n, d in enumerate(drafts):
        parents = [p for p in drafts[:n] if p is not None and not p[3] and len(p[2]) == 1
                   and (tuple(p[2][0]), *p[4]) in probes]
        if d is None or d[3] or len(d[2]) != 1 or not isinstance(d[1]["prompt"], list) or not parents \
                or rng.random() > 0.3:
            continue
        parent = rng.choice(parents)
        out = probes[(tuple(parent[2][0]), *parent[4])]
        ids = parent[2][0] + out[:rng.randrange(0, len(out) + 1)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
        d[1]["prompt"] = list(ids)
        d[2][0] = ids
    await probe()
    if rng.random() < 0.4:  # an EOS the model is seen to write
        seen = [t for out in probes.values() for t in out]
        if seen:
            case.eos = (rng.choice(seen),)
    case.calls = [b.call(d, probes) if d is not None else b.invalid_call() for d in drafts]
    valid = [c for c in case.calls if c.status == 200]
    for _ in range(rng.choice([0, 0, 1, 3]) if valid else 0):  # the same request twice in a round
        twin = copy.deepcopy(rng.choice(valid))
        if rng.random() < 0.5:  # the same choices streamed, or not: each must reassemble to the reference's
            stream = not twin.body.pop("stream", False)
            twin.body.pop("stream_options", None)
            if stream:
                twin.body["stream"] = True
        b.client_side(twin)
        case.calls.append(twin)
    return case


async def run_reference(engine: Engine, work: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    results = await engine.generate_async([w[0] for w in work], [w[1] for w in work]) if work else []
    return [r.output_ids for r in results]


def reference_engine(page_size: int, eos: tuple = ()) -> Engine:
    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=8192 // page_size, page_size=page_size,
                              enable_prefix_cache=False, max_running_requests=1, max_new_tokens_limit=4096))
    set_eos(eng, eos)
    return eng


def set_eos(engine: Engine, eos: tuple) -> None:
    """The tiny preset has no EOS (a random model would end at random): a case may give it one, the same
    in both engines, so that the server's EOS handling (its text hidden, ignore_eos) is exercised."""
    if eos:
        engine.model_config = dataclasses.replace(engine.model_config, eos_token_id=eos[0])


async def expect(case: Case) -> None:
    """Each valid choice's (text, token ids, finish_reason): the no-cache engine's tokens for its
    prompt and params, then the stop strings, on the text decoded after the prompt. A forced-greedy
    choice's (top_k 1 or min_p 1) also at temperature 0: the same tokens and logprobs, else
    `case.oracle_problems` says so."""
    tok = make_tokenizer(case.tokenizer)
    eng = reference_engine(case.page_size, case.eos)
    choices = [c for call in case.calls if call.status == 200 for c in call.choices]
    twins = {c.key(): (tuple(c.ids), dataclasses.replace(c.params, temperature=0.0))
             for c in choices if forced_greedy(c.params)}
    params = {c.key(): c.params for c in choices} | {t: t[1] for t in twins.values()}
    keys = list(params)
    results = await eng.generate_async([list(k[0]) for k in keys], [params[k] for k in keys]) if keys else []
    await eng.shutdown()
    got = {k: r for k, r in zip(keys, results)}
    for key, twin in twins.items():
        case.oracle_problems += forced_greedy_problems(key, got[key], got[twin])
    for call in case.calls:
        for c in call.choices if call.status == 200 else ():
            r = got[c.key()]
            c.expected = apply_stops(tok, [] if c.chat else c.ids, r.output_ids, r.finish_reason, call.stops)
            if r.logprobs is not None:
                c.ref_logprobs = reference_entries(tok, c.expected[1], r.logprobs)

"""Speculative decoding by prompt lookup (vLLM's `{"method": "ngram"}`): drafts from the request's own tokens, or
from what followed its context in the prefix cache, verified in one forward over the prefix cache.

A decode step of a small batch is a weight read: at the 8B shape on the H200 one token costs ~4.5 ms, and a
verify step of up to 8 rows over the same cached context ~4.6 ms (docs/benchmarks.md, session 47). So a
step may as well check up to k guesses. The guesses come from the context itself: the longest suffix of the request's tokens (prompt and
output, between `prompt_lookup_min` and `prompt_lookup_max` tokens) that also occurs earlier proposes the
k tokens that followed its latest earlier occurrence. Answers that repeat their input (code edits, quotes,
summaries, RAG, structured output over a document) accept several a step. Before that, with `cache_lookup` (this
engine's key, on by default), the prefix cache is asked: when the request's whole context so far is a path in the
radix tree that goes on, an earlier request with that context answered that way, and the path's next tokens are
the drafts (hicache/continuations.py). A prompt served again (a retry, an evaluation re-run, an agent's loop) then
decodes its earlier answer k + 1 tokens a step, at temperature 0 and as long as the tree holds it, in any tier;
a salted request meets only its own salt's answers, as its prefix hits do.

One verify step per request: its pending token and its k drafts at positions p .. p + k, a tail forward
over its cached pages (a verify graph of k + 1 rows a sequence rounded up to a power of two, every row's
logits: `verify_rows`). Row i's greedy token checks draft
i + 1: the drafts up to the first miss are accepted, and the row after them gives one more token, so a step
yields 1 .. k + 1 tokens, each equal to what greedy decoding one token at a time would give (up to bf16
rounding near ties: a many-row forward rounds as a tail, as after a restore). The K/V of the rejected drafts
was written to the request's own pages past its length and is overwritten by the tokens that follow; the
tree only ever takes pages below a request's length, so it never sees them.

A sampled request's rows are drawn as plain steps draw (temperature, min_p, top-k, top-p; the sampler's kernels on
CUDA), and the same `accept` takes the drafts up to the first row whose draw differs, then that draw. That is
rejection sampling of a draft with no distribution of its own (vLLM's ngram drafts; Leviathan et al., 2023): with p
a row's distribution and q all on the draft d, d is accepted with probability min(1, p(d) / q(d)) = p(d), and a
rejection draws from max(p - q, 0) normalized, p without d: exactly a draw from p that differs from d. So each
token follows the plain step's distribution, row after row.

Who speculates: greedy requests (temperature 0) and sampled ones without a seed: `eligible`. Penalties, logit_bias
and min_tokens score each verify row as the plain step after its drafts would: row j counts the drafts before it
as generated (`verify_penalties`; scheduler/penalty_state.py `draft_ids`), and holds the stop ids while its own
token is one of the first min_tokens. Token bans (allowed_token_ids, bad words) judge row j by the output and the
drafts before it (`verify_bans`), and each token taken by its own history (step_extras `fail_if_banned`). A
structured output's drafts are cut where its grammar would refuse one, and row j is masked by the grammar's state
after the drafts before it (scheduler/guided.py `fill_verify_masks`, llguidance's masks with draft tokens); with
min_tokens, a row where the grammar allows only the held stop ids does not hold them, as a plain step would not
(penalty_state `unheld_rows`). Logprobs come from every
row of a verify step, each accepted token's from the row that chose it (the raw logits', as a plain step's). A
seeded request decodes plainly: whether its step verifies depends on what else runs, and its tokens must not.
The others decode as before, in steps of their own; when both kinds run, the loop alternates a verify step and
a decode step.
A verify step is never chained behind the step in flight (its drafts need that step's tokens on the host);
a decode step is, unless a draft may come next (`Speculator.verifies`). Whether drafts are verified at all is
the cost policy's call (scheduler/draft_policy.py): a step verifies when the drafts its requests are expected to
have accepted pay for what it costs over a decode step.
"""
from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from hicache.continuations import Joined, Tails, attached, continuation
from scheduler.draft_policy import DraftPolicy
from scheduler.request import RequestState

TAIL_ROWS = 16  # a verify step's rows per sequence at most (scheduler/cuda_graphs.py TAIL_ROWS): k <= 15
METHODS = ("ngram",)
DRAFT_POLICIES = ("cost", "always")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` for method "ngram" (prompt lookup). The lookup bounds are filled as vLLM's
    are: both 5 when neither is given, each the other when one is. This engine's keys: draft_policy, "cost"
    verifies only when the drafts expected to be accepted pay for the step (scheduler/draft_policy.py), "always"
    whenever a draft is found (vLLM's way); cache_lookup (default true), drafts first from what followed the
    request's whole context in the prefix cache (hicache/continuations.py), then by prompt lookup."""

    num_speculative_tokens: int
    # None: filled as vLLM fills them (__post_init__: the other bound, or 5), in the dataclass as from the flag
    # (regression: the dataclass kept 5 for a bound left out, where the flag's same keys took the other bound)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    method: str = "ngram"
    draft_policy: str = "cost"
    cache_lookup: bool = True

    def __post_init__(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name in ("prompt_lookup_min", "prompt_lookup_max"):  # (the one given, before the other is made of it:
            # regression, a max of 0 was said of the min)
            given = getattr(self, name)
            if given is not None and (not isinstance(given, int) or isinstance(given, bool) or given < 1):
                raise ValueError(f"speculative {name} must be an integer >= 1, got {given!r}")
        if lo is None and hi is None:
            lo = hi = 5
        object.__setattr__(self, "prompt_lookup_min", hi if lo is None else lo)
        object.__setattr__(self, "prompt_lookup_max", lo if hi is None else hi)
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not served: only {list(METHODS)} "
                             "(prompt lookup; this engine has no draft model)")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {value!r}")
        if self.num_speculative_tokens > TAIL_ROWS - 1:
            raise ValueError(f"speculative num_speculative_tokens must be at most {TAIL_ROWS - 1} (a verify step "
                             f"is one tail of at most {TAIL_ROWS} rows), got {self.num_speculative_tokens}")
        if not isinstance(self.cache_lookup, bool):
            raise ValueError(f"speculative cache_lookup must be true or false, got {self.cache_lookup!r}")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"speculative draft_policy must be one of {list(DRAFT_POLICIES)}, got {self.draft_policy!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> "SpeculativeConfig | None":
        """A JSON object (the flag's text) or a mapping -> the config; None, "" or {} -> None (off)."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"--speculative-config must be a JSON object, got {type(value).__name__}")
        if not value:
            return None
        fields = dict(value)
        unknown = sorted(set(fields) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                                        "draft_policy", "cache_lookup"})
        if unknown:
            raise ValueError(f"--speculative-config: unknown or unserved keys {unknown} (method 'ngram' takes "
                             "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, draft_policy and "
                             "cache_lookup)")
        if "method" not in fields:
            raise ValueError("--speculative-config needs a method (this engine serves 'ngram')")
        if fields["method"] == "[ngram]":  # (vLLM's older spelling)
            fields["method"] = "ngram"
        if "num_speculative_tokens" not in fields:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        return cls(**fields)  # (the lookup bounds left out filled there)


def eligible(params) -> bool:
    """Whether a request's steps may be verified in bulk: greedy or sampled without a seed (the module doc;
    SamplingParams; logprobs are read from the rows, penalties, logit_bias, min_tokens, bans and a grammar's masks
    applied to them: `verify_penalties`, `verify_bans`)."""
    return params.temperature == 0.0 or params.seed is None


class TokenHistory:
    """A request's tokens as packed int32 (prompt, then output as it grows: `sync`), for lookups at C speed
    (bytes.rfind) instead of a Python scan per step."""

    __slots__ = ("_buf", "_count")

    def __init__(self) -> None:
        self._buf = array("i")
        self._count = 0

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Append what is new since the last call (the prompt first, then the output)."""
        have = self._count
        if have < len(prompt):
            self._buf.extend(prompt[have:])
            have = len(prompt)
        done = have - len(prompt)
        if done < len(output):
            self._buf.extend(output[done:])
        self._count = len(self._buf)

    def __len__(self) -> int:
        return self._count

    def propose(self, k: int, n_min: int, n_max: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of n tokens,
        n_max >= n >= n_min, that occurs earlier; [] when none does."""
        buf, total = self._buf, self._count
        data = buf.tobytes()
        size = buf.itemsize
        for n in range(min(n_max, total - 1), n_min - 1, -1):
            suffix = data[(total - n) * size:]
            hi = (total - 1) * size  # an occurrence ends before the last token (one token at least follows it)
            while (at := data.rfind(suffix, 0, hi)) >= 0:
                if at % size == 0:
                    start = at // size + n
                    return buf[start:start + k].tolist()
                hi = at + len(suffix) - 1  # a match across token boundaries: look left of it
        return []


def verify_rows(num_speculative_tokens: int) -> int:
    """Rows a sequence takes in a verify graph (scheduler/cuda_graphs.py): its drafts and pending token, rounded up
    to a power of two (at most TAIL_ROWS). Fewer rows a sequence keep more sequences within the skinny
    projections' 64 rows (kernels/skinny_gemm.py) and give cuBLAS fewer rows past them."""
    rows = 2
    while rows < num_speculative_tokens + 1:
        rows *= 2
    return min(rows, TAIL_ROWS)


def accept(drafts: Sequence[int], greedy: Sequence[int]) -> list[int]:
    """The tokens a verify step yields: greedy [len(drafts) + 1] holds the token chosen after the pending
    token (row 0) and after each draft (row i): greedy, or a sampled request's draw. The drafts up to the first
    that differs from the token chosen before it, then the token chosen after the last accepted one."""
    n = 0
    while n < len(drafts) and drafts[n] == greedy[n]:
        n += 1
    return list(greedy[:n + 1])


class Speculator:
    """The engine's speculative steps (EngineConfig.speculative): which decode step runs next (`split`, from
    Admission.decode_batch), the verify batch, and its tokens taken (`after_verify`)."""

    def __init__(self, engine, config: SpeculativeConfig, max_seqs: int) -> None:
        self.engine, self.config = engine, config
        self.max_seqs = max_seqs  # most sequences a verify step takes (the verify graphs'; more: plain decode)
        self._others_turn = False  # both kinds running: the next decode step is the others'
        self.policy = DraftPolicy() if config.draft_policy == "cost" else None
        # vLLM's spec_decode counters: drafts (a request's drafts in one step), their tokens, those accepted, and
        # per draft position those accepted
        # (and this engine's: steps with drafts that the cost policy decoded plainly; drafts from the prefix cache,
        # `cache_draft`, and their tokens accepted)
        self.stats = {"verify_steps": 0, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                      "accepted_per_pos": [0] * config.num_speculative_tokens, "declined_steps": 0,
                      "cache_drafts": 0, "cache_accepted_tokens": 0}
        self._from_cache: set[int] = set()  # ids of the requests whose drafts this step came from the prefix cache
        self._cache_lookup = config.cache_lookup and engine.config.enable_prefix_cache
        self.tails = Tails()  # finished requests' tokens past their last published page (remember_tail)

    def ends_chain(self, running: list, chained: list) -> bool:
        """Whether a decode chain of `chained` must end here: a decoding request it leaves out (an eligible one,
        whose turn the plain step took: regression, it waited for the whole chain, the others' every step), or
        a verify step that may come next (`verifies`)."""
        chained_ids = {id(r) for r in chained}
        if any(r.state is RequestState.DECODE and id(r) not in chained_ids for r in running):
            return True
        return self.verifies(running)

    def verifies(self, running: list) -> bool:
        """Whether the decode step after the one in flight may be a verify step (then it is not chained): some
        eligible request, at most `max_seqs` of them, may have a draft then. Its lookup suffix ends with the
        token in flight, unknown here; but any n-gram it could match (n >= prompt_lookup_min) ends with the
        prompt_lookup_min - 1 tokens before it, which must then occur earlier, with a token after them; or the
        prefix cache holds two tokens after its context (the first may be the one in flight). Where
        they do not (most steps of an answer that repeats nothing, at vLLM's default of 5), the chain goes on; so
        it does where the cost policy would not verify those that may (each at most k accepted)."""
        spec = [r for r in running if not r.state.done and eligible(r.params)]
        if not 0 < len(spec) <= self.max_seqs:
            return False
        before = self.config.prompt_lookup_min - 1
        may = []  # those that may have a draft (a 1-gram: any token may have occurred before)
        for req in spec:
            try:
                if req.spec_history is None:
                    req.spec_history = TokenHistory()
                req.spec_history.sync(req.prompt, req.output)
                if (before == 0 or req.spec_history.propose(1, before, before)
                        or self._cache_lookup and len(self.cache_draft(req, 2)) == 2):  # (its 1st: the token in flight)
                    may.append(req)
            except Exception as exc:  # (its step in flight is dropped, as an abort's: `after_step`)
                self.engine.fail_own_work(req, "looking up this request's speculative drafts", exc)
        if not may or self.policy is None:
            return bool(may)
        k = self.config.num_speculative_tokens  # (the most they could accept: a step pays at best this)
        return self.policy.pays(len(spec), sum(self.policy.expected(r, k) for r in may))

    def split(self, reqs: list) -> tuple[list, list[tuple[object, list[int]]] | None]:
        """reqs: the decoding requests -> (those for a plain decode step, None), or ([], the eligible
        requests with their drafts) for a verify step. A verify step runs when some eligible request has a
        draft, at most `max_seqs` are eligible, and it is not the others' turn."""
        spec = [r for r in reqs if eligible(r.params)]
        others = [r for r in reqs if not eligible(r.params)]
        self._from_cache.clear()
        if not spec or len(spec) > self.max_seqs:
            return reqs, None
        if others and self._others_turn:
            self._others_turn = False
            return others, None
        drafted = []
        for req in spec:
            room = req.params.max_tokens - len(req.output) - 1  # (the step's own token is the last it may have)
            k = min(self.config.num_speculative_tokens, room)
            try:
                draft = self.draft(req, k) if k > 0 else []
                if req.guide is not None:  # (those its grammar takes: scheduler/guided.py)
                    draft = req.guide.valid_drafts(draft)
            except Exception as exc:  # its own: it fails alone, and the step goes on without it (`_decode_step`)
                self.engine.fail_own_work(req, "proposing this request's speculative drafts", exc)
                continue
            drafted.append((req, draft))
        if not any(d for _, d in drafted):
            return reqs, None
        if self.policy is not None and not self.policy.pays(len(drafted), sum(
                self.policy.expected(r, len(d)) for r, d in drafted if d)):
            self.stats["declined_steps"] += 1
            return reqs, None
        self._others_turn = bool(others)
        return [], drafted

    def draft(self, req, k: int) -> list[int]:
        """Up to k drafts after `req`'s tokens: what followed its whole context in the prefix cache (`cache_draft`,
        with cache_lookup), else prompt lookup over them (its TokenHistory, made at its first)."""
        if self._cache_lookup and (drafts := self.cache_draft(req, k)):
            self._from_cache.add(id(req))
            return drafts
        if req.spec_history is None:
            req.spec_history = TokenHistory()
        req.spec_history.sync(req.prompt, req.output)
        return req.spec_history.propose(k, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def cache_draft(self, req, k: int) -> list[int]:
        """Up to k tokens that followed `req`'s whole context (its cache_prompt, then its output) in a sequence the
        prefix cache holds (hicache/continuations.py); the walk goes on from the anchor its last one left."""
        tree = self.engine.cache.tree
        prompt, output = req.cache_prompt, req.output
        node, pos = req.draft_anchor if req.draft_anchor is not None else (tree.root, 0)
        if not attached(tree, node):
            node, pos = tree.root, 0
        drafts, node, end = continuation(tree, Joined(prompt, output), k, node, self.tails, start=pos)
        req.draft_anchor = (node, end)  # (its context read in place: no copy of its whole output a step)
        return drafts

    def remember_tail(self, req) -> None:
        """A finished request, its whole pages just published: keep its tokens past them (its last partial page
        and last token) as drafts for the next request with its context (hicache/continuations.py Tails)."""
        if self._cache_lookup and req.locked_node is not None:
            end = req.locked_len
            tail = req.output[end - len(req.cache_prompt):] if end >= len(req.cache_prompt) else \
                req.cache_prompt[end:] + req.output
            if 0 < len(tail) <= 2 * self.engine.cache.tree.page_size:
                self.tails.put(req.locked_node, tail)

    def after_verify(self, reqs: list, drafts: list[list[int]], greedy: list[list[int]], after_step) -> int:
        """A verify step's tokens: per request, its accepted drafts and the token after them, each through
        `after_step(req, 1, token)` until the request ends. -> the tokens taken (those its requests kept: a NaN
        mark, or a token its bans refuse, fails its request and is none; as a plain step's)."""
        taken = 0
        self.stats["verify_steps"] += 1
        stats = self.stats
        for req, draft, rows in zip(reqs, drafts, greedy):
            tokens = accept(draft, rows)
            # (a request ended before its step's tokens came, aborted or failed by its own inputs, takes none: its
            # drafts count nowhere; regression: counted accepted, and learned by the draft policy)
            if draft and not req.state.done:
                if self.policy is not None:
                    self.policy.observe_request(req, len(tokens) - 1)
                stats["drafts"] += 1
                stats["draft_tokens"] += len(draft)
                stats["accepted_tokens"] += len(tokens) - 1
                if id(req) in self._from_cache:
                    stats["cache_drafts"] += 1
                    stats["cache_accepted_tokens"] += len(tokens) - 1
                for pos in range(len(tokens) - 1):
                    stats["accepted_per_pos"][pos] += 1
            rows_allow_none = req.guide.rows_allow_none if req.guide is not None else None
            for i, token in enumerate(tokens):
                if req.state.done:
                    break
                if rows_allow_none is not None:  # (the mask of the row that chose it: `after_step` reads it)
                    req.guide.allows_none = rows_allow_none[i]
                kept = len(req.output)
                after_step(req, 1, token, same_step=i > 0)
                taken += len(req.output) - kept  # (the tokens kept: not a NaN mark, nor one its bans fail it at)
            if rows_allow_none is not None:
                req.guide.rows_allow_none = None
        return taken


def row_starts(new_lens: list[int], stride: int) -> list[int]:
    """A verify step's layout: the first row of each sequence in its logits, sequence b's new_lens[b] rows from
    b * stride (a verify graph's padded layout) or right after the sequence before's (stride 0: packed)."""
    if stride:
        return [b * stride for b in range(len(new_lens))]
    starts, row = [], 0
    for n in new_lens:
        starts.append(row)
        row += n
    return starts


def sampled_rows(new_lens: list[int], temperatures: list[float], stride: int) -> tuple[list[int], list[int]]:
    """A verify step's rows of sampled sequences (temperature > 0) in its logits (`row_starts`; a graph's padding
    rows left out), and the sequence of each."""
    rows, seqs = [], []
    for b, (start, n, temperature) in enumerate(zip(row_starts(new_lens, stride), new_lens, temperatures)):
        if temperature > 0.0:
            rows.extend(range(start, start + n))
            seqs.extend([b] * n)
    return rows, seqs


def verify_penalties(penalties: list, drafts: list[list[int]], new_lens: list[int], stride: int,
                     num_rows: int) -> list:
    """A verify step's penalty rows (scheduler/penalty_state.py RowPenalties, per sequence or None) laid out as
    its logits' num_rows rows (`row_starts`): row j of sequence b its request's, with drafts[b][:j] as generated
    before it, and no stop ids held where its grammar allows nothing else (`unheld_rows`); padding rows None.
    (The rows of one request share its state: each takes the same host tokens.)"""
    out: list = [None] * num_rows
    for start, pen, draft, n in zip(row_starts(new_lens, stride), penalties, drafts, new_lens):
        if pen is not None:
            out[start:start + n] = [pen._replace(draft_ids=tuple(draft[:j]),
                                                 **({"stop_ids": ()} if j in pen.unheld_rows else {}))
                                    for j in range(n)]
    return out


def verify_bans(bans: list, drafts: list[list[int]], new_lens: list[int], stride: int, num_rows: int) -> list:
    """A verify step's token bans (scheduler/token_bans.py RowBans, per sequence or None) laid out as its logits'
    num_rows rows (`row_starts`): row j of sequence b its request's, its output followed by drafts[b][:j] (only
    the tail a bad word can match: as many tokens as its longest word); padding rows None. (The rows share its
    state: its mask.)"""
    out: list = [None] * num_rows
    for start, ban, draft, n in zip(row_starts(new_lens, stride), bans, drafts, new_lens):
        if ban is not None:
            keep = max((len(w) for w in ban.words), default=0)
            recent = list(ban.output_ids[max(0, len(ban.output_ids) - keep):]) if keep else []
            out[start:start + n] = [ban] + [ban._replace(output_ids=recent + draft[:j]) for j in range(1, n)]
    return out


def graph_rows(packed: list[int], new_lens: list[int], stride: int) -> list[int]:
    """Rows of a verify step counted as if packed (`row_starts` with stride 0) -> the same rows in its logits
    (`row_starts` with `stride`)."""
    if not stride:
        return list(packed)
    seq_of = [(b, j) for b, n in enumerate(new_lens) for j in range(n)]
    return [seq_of[r][0] * stride + seq_of[r][1] for r in packed]


def rows_of(ids: list[int], new_lens: list[int], stride: int) -> list[list[int]]:
    """A verify step's greedy ids per sequence: the first new_lens[b] rows of sequence b (`row_starts`)."""
    return [ids[start:start + n] for start, n in zip(row_starts(new_lens, stride), new_lens)]

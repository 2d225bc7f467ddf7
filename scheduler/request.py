"""Requests, sampling parameters and their lifecycle states."""
from __future__ import annotations

import asyncio
import enum
import hashlib
import itertools
import numbers
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple


class RequestError(ValueError):
    """Bad input for one request: reported to that request, never raised into the loop. `param`:
    the request field to change, where it is not the prompt (the HTTP error names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes
if TYPE_CHECKING:
    from scheduler.guided import GuidedSpec

PRIORITY_MIN, PRIORITY_MAX = -(1 << 63), (1 << 63) - 1  # (vLLM's is any int; a 64-bit one here)
MAX_LOGPROBS = 20  # alternatives a request may ask for at each position (OpenAI's top_logprobs limit)
PRESENCE_FREQUENCY_MAX = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
REPETITION_MAX = 10.0  # repetition_penalty in (0, REPETITION_MAX] (vLLM: > 0; a bound keeps it sane)
LOGIT_BIAS_MAX = 100.0  # a logit_bias value in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] (OpenAI's range)
LOGIT_BIAS_MAX_TOKENS = 1024  # token ids one request may bias (each is uploaded and added at every step)
# vLLM's allowed_token_ids and bad words (scheduler/token_bans.py): the ids a request may allow (checked on the
# host, uploaded once as a mask), its bad words (vLLM's cap on their number) and their tokens in all (matched
# on the host at every step)
ALLOWED_TOKEN_IDS_MAX = 1 << 18  # (any vocabulary up to 262,144 ids, Gemma 3's, whole)
BAD_WORDS_MAX = 128
BAD_WORDS_MAX_TOKENS = 1024
MIN_TEMPERATURE = 0.01  # a positive temperature below it samples at it (vLLM's _MAX_TEMP: smaller ones overflow there)


def salted_prompt(prompt: list[int], salt: str) -> list[int]:
    """The tokens the prefix cache keys a salted prompt by: the prompt with its first token replaced by
    a negative id, 62 bits of blake2b(salt, token). No model token is negative, so a salted prompt
    matches no unsalted one in any tier, nor one of another salt (short of a 62-bit collision), and
    every later page's key (the tree's, a shared L3's chained hash) follows from its first. The model
    still computes the prompt itself."""
    digest = hashlib.blake2b(f"{len(salt)}:{salt}:{prompt[0]}".encode(), digest_size=8).digest()
    return [-1 - (int.from_bytes(digest, "little") >> 2)] + prompt[1:]


def kv_tokens(prompt_tokens: int, max_tokens: int) -> int:
    """Tokens whose K/V a request can write: its prompt and every generated token but the last
    (nothing runs after the last one); max_tokens 0 (a prefill alone): its prompt."""
    return prompt_tokens + max(max_tokens - 1, 0)


def _is_integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    # vLLM's top_k and min_p (scheduler/sampling.py): the k likeliest tokens (0 or -1: all), the tokens at
    # least min_p times as likely as the likeliest (0: all); greedy rows (temperature 0) ignore both
    top_k: int = 0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: each generated token's logprob and the k likeliest tokens'
    # vLLM's penalties (scheduler/penalty_state.py `apply_penalties`): presence and frequency over the tokens
    # generated so far, repetition over the prompt's and those; 0, 0 and 1 change nothing
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: token id -> a bias added to its logit before the penalties (vLLM's order);
    # None or {}: none (scheduler/penalty_state.py). Not hashed: a dict
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    # vLLM's min_tokens: no stop condition but max_tokens ends it before it has generated this many tokens
    # (its stop ids masked on the device, scheduler/penalty_state.py; stop strings: scheduler/stop_strings.py)
    min_tokens: int = 0
    # vLLM's allowed_token_ids: only these may be sampled (None: all); vLLM's bad words as token ids (the server
    # tokenizes the API's strings): a one-token word is never sampled, a longer one's last token is not sampled
    # where the request's last output tokens are the rest of it (vLLM V1: output tokens only, not the prompt's).
    # Both at -inf on the device (scheduler/token_bans.py); validate() keeps tuples of what it checked
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's prompt_logprobs: None off; k: each prompt token's logprob given the tokens before it (the first
    # has none) and the k likeliest tokens'. Its prompt is computed whole: it takes no cached prefix
    # (Admission._reusable). Only with it may max_tokens be 0: the prefill alone (OpenAI's echo, lm-eval)
    prompt_logprobs: int | None = None
    # vLLM's priority (EngineConfig.scheduling_policy "priority"): the queue admits lower values first, in
    # arrival order among equals; a running request is never preempted for it (where L1 runs short, under
    # decode_reserve_ratio < 1, the least urgent is preempted first: scheduler/reservations.py)
    priority: int = 0
    # structured outputs (scheduler/guided.py): what the answer must be (a JSON schema, a regex, ...); None: free
    guided: GuidedSpec | None = None
    # vLLM's cache_salt: requests share cached prefixes (every tier, a shared L3's keys too) only with requests
    # of the same salt, so one tenant cannot time another's prompts out of the cache; None: the common pool
    cache_salt: str | None = None

    def validate(self, max_new_tokens_limit: int, vocab_size: int | None = None) -> None:
        """Raises RequestError naming the field; token ids (logit_bias') within [0, vocab_size) when given."""
        self._check_logprobs("prompt_logprobs")
        least = 0 if self.prompt_logprobs is not None else 1  # (0: the prefill alone, for its prompt logprobs)
        if not _is_integer(self.max_tokens) or self.max_tokens < least:  # (numpy's integers too, as the others)
            raise RequestError(f"max_tokens must be an integer >= 1 (0 only with prompt_logprobs), "
                               f"got {self.max_tokens!r}", "max_tokens")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))  # (a Python int, for the logs and pages)
        if self.max_tokens > max_new_tokens_limit:
            raise RequestError(f"max_tokens {self.max_tokens} exceeds the limit {max_new_tokens_limit}", "max_tokens")
        if not _is_integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], "
                               f"got {self.min_tokens!r}", "min_tokens")
        # every field's type too: a bad one raised out of add_request, or (stop_token_ids=None) in the loop
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be a number in [0, 100], got {self.temperature!r}", "temperature")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # vLLM's: raised to 0.01 (regression: 0.001 sampled as greedy)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_integer(self.top_k) or self.top_k < -1:
            raise RequestError(f"top_k must be an integer >= -1 (0 or -1: all tokens), got {self.top_k!r}", "top_k")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be a number in [0, 1], got {self.min_p!r}", "min_p")
        if self.seed is not None and not (_is_integer(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise RequestError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (a 64-bit integer), got {self.seed!r}",
                               "seed")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(map(_is_integer, self.stop_token_ids)):
            raise RequestError(f"stop_token_ids must be a tuple of token ids, got {self.stop_token_ids!r}",
                               "stop_token_ids")
        # a tuple of what was checked (regression: a caller's list changed after add_request crashed the loop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}", "ignore_eos")
        self._check_logprobs("logprobs")
        if not _is_integer(self.priority) or not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise RequestError(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], "
                               f"got {self.priority!r}", "priority")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -PRESENCE_FREQUENCY_MAX <= value <= PRESENCE_FREQUENCY_MAX:
                raise RequestError(f"{name} must be a number in [-{PRESENCE_FREQUENCY_MAX}, {PRESENCE_FREQUENCY_MAX}], "
                                   f"got {value!r}", name)
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= REPETITION_MAX:
            raise RequestError(f"repetition_penalty must be a number in (0, {REPETITION_MAX}] (1: off), "
                               f"got {self.repetition_penalty!r}", "repetition_penalty")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise RequestError(f"cache_salt must be a non-empty string or None, got {self.cache_salt!r}", "cache_salt")
        if self.cache_salt is not None:
            try:  # (keyed by its UTF-8: regression: a lone surrogate raised in the loop's admission, which died)
                self.cache_salt.encode("utf-8")
            except UnicodeError as exc:
                raise RequestError(f"cache_salt is not valid Unicode text: {exc}", "cache_salt") from None
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias, vocab_size)
            # a copy of what was checked: the caller's dict may change after this check (an id outside
            # the vocabulary would reach the device's index_put)
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        _check_bans(self, vocab_size)

    def _check_logprobs(self, name: str) -> None:
        value = getattr(self, name)
        if value is not None and not (_is_integer(value) and 0 <= value <= MAX_LOGPROBS):
            raise RequestError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}", name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes its logits (else its batches build no penalty inputs)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a bias changes its logits (else its batches build no such inputs)."""
        return self.penalized or bool(self.logit_bias)

    @property
    def restricts_tokens(self) -> bool:
        """Whether allowed_token_ids or a bad word bans tokens (else its batches build no ban inputs)."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)


def _check_logit_bias(bias, vocab_size: int | None) -> None:
    if not isinstance(bias, Mapping):
        raise RequestError(f"logit_bias must be a dict of token id -> bias, got a {type(bias).__name__}", "logit_bias")
    if len(bias) > LOGIT_BIAS_MAX_TOKENS:
        raise RequestError(f"logit_bias may bias at most {LOGIT_BIAS_MAX_TOKENS} token ids, got {len(bias)}",
                           "logit_bias")
    top = "" if vocab_size is None else f", below the vocabulary size {vocab_size}"
    for token, value in bias.items():
        if not _is_integer(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
            raise RequestError(f"logit_bias' token ids must be integers >= 0{top}, got {token!r}", "logit_bias")
        if not _is_real(value) or not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX:  # (NaN fails both)
            raise RequestError(f"logit_bias' values must be numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], "
                               f"got {value!r} for token {token}", "logit_bias")


def _token_ids(ids, vocab_size: int | None) -> bool:
    return isinstance(ids, (tuple, list)) and all(
        _is_integer(t) and t >= 0 and (vocab_size is None or t < vocab_size) for t in ids)


def _check_bans(params: SamplingParams, vocab_size: int | None) -> None:
    """allowed_token_ids and bad_words_token_ids (RequestError naming the field); each kept as tuples of what was
    checked (a caller's list may change after the check: an id outside the vocabulary would reach the device)."""
    top = "" if vocab_size is None else f" below the vocabulary size {vocab_size}"
    allowed, words = params.allowed_token_ids, params.bad_words_token_ids
    if allowed is not None:
        if not _token_ids(allowed, vocab_size) or not allowed:
            raise RequestError(f"allowed_token_ids must be None or a non-empty tuple of token ids (integers "
                               f">= 0{top}), got {allowed!r}"[:400], "allowed_token_ids")
        if len(allowed) > ALLOWED_TOKEN_IDS_MAX:
            raise RequestError(f"allowed_token_ids may allow at most {ALLOWED_TOKEN_IDS_MAX} token ids, got "
                               f"{len(allowed)}", "allowed_token_ids")
        allowed = tuple(dict.fromkeys(allowed))
    if not isinstance(words, (tuple, list)) or not all(w and _token_ids(w, vocab_size) for w in words):
        raise RequestError(f"bad_words_token_ids must be a tuple of bad words, each a non-empty tuple of token ids "
                           f"(integers >= 0{top}), got {words!r}"[:400], "bad_words_token_ids")
    if len(words) > BAD_WORDS_MAX or sum(map(len, words)) > BAD_WORDS_MAX_TOKENS:
        raise RequestError(f"bad_words_token_ids may hold at most {BAD_WORDS_MAX} bad words of "
                           f"{BAD_WORDS_MAX_TOKENS} tokens in all, got {len(words)} of {sum(map(len, words))}",
                           "bad_words_token_ids")
    words = tuple(map(tuple, words))
    if allowed is not None and set(allowed) <= {w[0] for w in words if len(w) == 1}:
        # (nothing could be sampled: the row's every logit at -inf)
        raise RequestError("every token of allowed_token_ids is a one-token bad word: nothing could be sampled",
                           "allowed_token_ids")
    object.__setattr__(params, "allowed_token_ids", allowed)
    object.__setattr__(params, "bad_words_token_ids", words)


class RequestState(enum.Enum):
    WAITING = "waiting"      # queued, no pages yet
    PARKED = "parked"        # waiting for a restore, or its L3 -> L2 prefetch (an overlapped restore's
                             # request is PREFILL, with overlap_op set)
    PREFILL = "prefill"      # admitted; prompt (partly) computed
    DECODE = "decode"        # generating
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED)


class TokenLogprobs(NamedTuple):
    """A generated (or prompt) token's log-probability and the k likeliest tokens' at its position:
    log_softmax of the model's raw logits, before temperature and top-p (vLLM's default), whatever was drawn."""
    logprob: float                  # the token's (in `top` too when it is one of the k)
    top: list[tuple[int, float]]    # (token id, logprob), the likeliest first; SamplingParams.logprobs of them
    rank: int | None = None         # a prompt token's: the tokens at least as likely, itself too (vLLM's rank);
                                    # None for a generated token's


@dataclass
class TokenEvent:
    """One streamed item: a generated token, or the end of the request."""
    rid: str
    token_id: int | None
    index: int
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # the token's, when its request asked (SamplingParams.logprobs)
    same_step: bool = False  # a token after the first of one engine step (a verify step's: scheduler/speculative.py)


@dataclass
class GenerationResult:
    rid: str
    prompt_tokens: int
    output_ids: list[int]
    finish_reason: str
    error: str | None
    cached_tokens: dict[str, int]
    ttft_s: float | None
    latency_s: float | None
    logprobs: list[TokenLogprobs] | None = None  # one per output id, when asked (SamplingParams.logprobs)
    # one per prompt token, the first None, when asked (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


_rid_counter = itertools.count()


def enqueue(waiting: deque["Request"], req: "Request") -> None:
    """Put `req` in the queue in admission order: by priority (lower first), then arrival; behind every
    request of its key or less, ahead of the rest (a new request is usually the last: O(1) then)."""
    key = (req.params.priority, req.arrival_s)
    if not waiting or (waiting[-1].params.priority, waiting[-1].arrival_s) <= key:
        waiting.append(req)
        return
    for i, other in enumerate(waiting):
        if (other.params.priority, other.arrival_s) > key:
            waiting.insert(i, req)
            return


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_rid_counter)}")
    state: RequestState = RequestState.WAITING
    output: list[int] = field(default_factory=list)
    # KV bookkeeping (L1). pages[i] holds tokens [i*page_size, (i+1)*page_size).
    claim: int | None = None
    pages: list[int] = field(default_factory=list)
    cached_len: int = 0          # tokens whose KV is in L1 and may be read
    locked_node: object = None   # tree node locked in L1 (protects the shared prefix we read)
    locked_len: int = 0          # tokens covered by locked_node's path
    chunks_unbacked: bool = False  # prompt chunks it published still wait for their write-through backup
    reserved_pages: int = 0      # pages this request may still need (admission reservation)
    # preemption (scheduler/reservations.py): output tokens its next prefill computes again after the prompt (0
    # once that prefill ended), how often it was preempted, and the hits its first admission reported
    resumed_tokens: int = 0
    preemptions: int = 0
    served_hits: dict[str, int] | None = None
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    recomputed_tokens: int = 0   # prompt tokens its prefill computed and kept (metrics.recomputed_tokens's share)
    restore_tier: str = "none"
    restore_l1_start: int = 0     # L1 prefix length when its parked restore started
    restore_op: object = None
    restore_failed: bool = False  # a restore failed: this request recomputes, never retries
    restore_declined: bool = False  # its last decision recomputes a lower-tier hit (a policy skip at admission)
    overlap_op: object = None     # a restore its tail forward runs behind (an L2 restore layer by layer, or a
                                  # prefetch taken on to L1), until settled
    overlap_result: object = None  # (chunk, token) of that forward, held until the restore has published
    prefetch_op: object = None
    follow_op: object = None      # another request's restore or prefetch of its prefix that it is parked on
                                  # (Restoring._try_restore; cancelled for it only once no live request
                                  # waits for it: Restoring.drop_ops)
    waits_for: str | None = None  # the request in prefill computing its prefix that it last waited for
                                  # (Admission._computes_prefix_of: logged once per request it waits for)
    prefix_checked: tuple | None = None  # what its last check against a request in prefill found (admission.py
                                         # `_agree`; still true after a preemption, which only extends its prefix)
    # ((its prefill's length, L1's change count), the tokens L1 held of it then): its last walk for the queue's order
    # under "lpm" (scheduler/reservations.py `_l1_held`: each prefill pass, walked again only once L1 changed)
    lpm_held: tuple | None = None
    landed_offered: bool = False  # its prefetch's read landed and the request was offered to take it on
    promoted_tokens: int = 0      # tokens an L3 read (its prefetch, its restore, or one it followed) promoted to L2
    promoted_end: int = 0         # where they end in its prefix (they are that read's tail: `promote`)
    hint_task: object = None      # shared L3: the existence query that must finish before admission
    hint_deferred: bool = False   # queued outside a running loop: that query (or its prefetch) starts on the
                                  # loop's next plan
    # scored once at the first token if it ran alone (hicache/outcomes.py): how many batches had ended
    # when it arrived, and per prefix source the seconds the cost model predicted to its first token
    arrival_batch: int = 0
    span_plan: dict | None = field(default_factory=dict)  # None: its path changed (a fault, a fallback): nothing to learn
    finish_reason: str | None = None
    error: str | None = None
    guide: object = None         # its grammar's matcher (scheduler/guided.py Guide) when params.guided
    spec_history: object = None  # its tokens for prompt lookup (scheduler/speculative.py TokenHistory) once it speculated
    draft_anchor: tuple | None = None  # where its last walk for drafts in the prefix cache covered its context whole
                                       # (a node and its end in tokens: hicache/continuations.py)
    # (the drafts its verify steps accepted, averaged; its output length then): scheduler/draft_policy.py
    spec_accepted: tuple[float, int] | None = None
    generator: object = None     # torch.Generator for seeded sampling
    rng_state: object = None     # the generator's state before an overlapped forward (undone if it is discarded)
    queue: asyncio.Queue | None = None
    arrival_s: float = field(default_factory=time.perf_counter)
    scheduled_s: float | None = None  # its first prefill's start: arrival to here is its time queued (or parked)
    first_token_s: float | None = None
    finish_s: float | None = None
    # its last forward's tokens and their logprobs, in order (one, or a verify step's rows), set after each step
    # of a request that asked (step_extras.keep_logprobs) and attached to the tokens' events by `emit` (the token
    # may be emitted later: an overlapped restore's forward is applied once the restore has published)
    step_logprobs: list[tuple[int, TokenLogprobs]] | None = None
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # its prompt tokens' logprobs so far (SamplingParams.prompt_logprobs), the first None: each prefill
    # chunk's rows add theirs (step_extras.keep_logprobs), all there before its first token is emitted
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    penalty_state: object = None  # its penalties' and logit_bias' inputs on the device, kept across its steps
                                  # (scheduler/penalty_state.py PenaltyState; made by step_extras.ask)
    _salted: list[int] | None = field(default=None, repr=False)  # cache_prompt's, made once

    @property
    def cache_prompt(self) -> list[int]:
        """The prompt as the prefix cache keys it (scheduler/admission.py, restoring.py): the prompt itself,
        or with SamplingParams.cache_salt its `salted_prompt`."""
        if self.params.cache_salt is None or not self.prompt:
            return self.prompt
        if self._salted is None:
            self._salted = salted_prompt(self.prompt, self.params.cache_salt)
        return self._salted

    @property
    def served_hit_tokens(self) -> dict[str, int]:
        """The prefix-cache hits its usage reports: its first admission's (a preempted request's resumption reads
        its own K/V, and `hit_tokens` is that admission's until its prefill ends)."""
        return self.hit_tokens if self.served_hits is None else self.served_hits

    @property
    def prefill_len(self) -> int:
        """Tokens its prefill computes K/V for: the prompt, and after a preemption the output up to then."""
        return len(self.prompt) + self.resumed_tokens

    @property
    def prefill_ids(self) -> list[int]:
        """The token ids of `prefill_len` (the prompt itself unless a preemption folded its output in)."""
        return self.prompt + self.output[:self.resumed_tokens] if self.resumed_tokens else self.prompt

    @property
    def cache_prefill(self) -> list[int]:
        """`prefill_ids` as the prefix cache keys them (`cache_prompt`, then the folded output)."""
        return self.cache_prompt + self.output[:self.resumed_tokens] if self.resumed_tokens else self.cache_prompt

    def promote(self, start_tokens: int, end_tokens: int, keep_longer: bool = False) -> None:
        """An L3 read (its prefetch, its restore, or one it followed) promoted [start, end) of its prefix to L2."""
        if not keep_longer or end_tokens - start_tokens > self.promoted_tokens:
            self.promoted_tokens, self.promoted_end = end_tokens - start_tokens, end_tokens

    def promoted_in(self, start_tokens: int, end_tokens: int) -> int:
        """Tokens of [start, end) that the read of `promote` brought, an L2 restore's share scored as L3
        (regression: min(promoted, restored) counted L2's own head as L3 where L2 had lost the read's tail since)."""
        first = self.promoted_end - self.promoted_tokens
        return max(0, min(end_tokens, self.promoted_end) - max(start_tokens, first))

    def emit(self, event: TokenEvent) -> None:
        if event.token_id is not None and self.step_logprobs and self.step_logprobs[0][0] == event.token_id:
            event.logprobs = self.step_logprobs.pop(0)[1]
            self.output_logprobs.append(event.logprobs)
        if self.queue is not None:
            self.queue.put_nowait(event)

    def result(self) -> GenerationResult:
        return GenerationResult(
            rid=self.rid, prompt_tokens=len(self.prompt), output_ids=list(self.output),
            finish_reason=self.finish_reason or "", error=self.error, cached_tokens=dict(self.served_hit_tokens),
            ttft_s=None if self.first_token_s is None else self.first_token_s - self.arrival_s,
            latency_s=None if self.finish_s is None else self.finish_s - self.arrival_s,
            logprobs=None if self.params.logprobs is None else list(self.output_logprobs),
            prompt_logprobs=None if self.params.prompt_logprobs is None else list(self.prompt_logprobs))

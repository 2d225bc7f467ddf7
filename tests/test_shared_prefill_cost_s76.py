"""What the shared-prefill wait (Admission._computes_prefix_of) costs the event loop (session 76's hunt). Every
prefill pass checks each queued request against each request in prefill, and the one in prefill grows what must
agree chunk by chunk. Regression: each check copied the queued request's whole prompt and compared the whole
prefix again, O(queued x prompt) per pass: 1,000 requests queued behind one 32k-token prompt took ~0.5 s of the
event loop per pass, every stream on the server stalled. Now each pair's tokens are compared once in all."""
from __future__ import annotations

import random

from structlog.testing import capture_logs

from scheduler.admission import PREFILL_SHARE_MIN_TOKENS
from scheduler.config import EngineConfig
from scheduler.logs import configure_logging, logging_state, restore_logging
from scheduler.engine import Engine
from scheduler.request import Request, RequestState, SamplingParams

PAGE = 4


class CountingList(list):
    """A prompt that counts the tokens its slices copy (each one a copy and, compared, a comparison)."""
    sliced_tokens = 0

    def __getitem__(self, key):
        got = super().__getitem__(key)
        if isinstance(key, slice):
            CountingList.sliced_tokens += len(got)
        return got


def _engine() -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE, num_pages=64))


def _sliced_while_a_sharer_prefills(prompt_tokens: int, num_waiting: int, chunk_tokens: int = 32) -> int:
    """Tokens sliced by every check of `num_waiting` queued requests, one per prefill pass, while the request in
    prefill computes its `prompt_tokens`-token prompt (which is theirs too, less their last token) chunk by chunk."""
    eng = _engine()
    shared = list(range(1, prompt_tokens + 1))
    leader = Request(CountingList(shared), SamplingParams(max_tokens=1))
    leader.state = RequestState.PREFILL
    eng.running.append(leader)
    waiting = [Request(CountingList(shared + [7]), SamplingParams(max_tokens=1)) for _ in range(num_waiting)]
    CountingList.sliced_tokens = 0
    for cached in range(0, prompt_tokens - PREFILL_SHARE_MIN_TOKENS + 1, chunk_tokens):
        leader.cached_len = cached
        assert [eng.admission._computes_prefix_of(req) for req in waiting] == [leader] * num_waiting
    return CountingList.sliced_tokens


def test_each_queued_request_compares_its_prefix_once_while_its_sharer_prefills_it():
    """Per queued request and prompt token, the tokens copied and compared over the sharer's whole prefill are a
    constant, each check comparing what the sharer's last chunk added, not the number of passes: 4 x the prompt is
    4 x the passes, and was 4 x the work per request. Quiet logging (no --log-json): the shared prefix's length,
    measured for the `prefill_waits` line alone, is not measured for a line that is dropped (it read it whole)."""
    state = logging_state()
    configure_logging(None)
    try:
        per_token = {}
        for prompt_tokens in (256, 1024):
            for num_waiting in (2, 8):
                sliced = _sliced_while_a_sharer_prefills(prompt_tokens, num_waiting)
                per_token[prompt_tokens, num_waiting] = sliced / (prompt_tokens * num_waiting)
    finally:
        restore_logging(state)
    # once each, in a slice of each side (was 13.5 at 256 tokens, 49.5 at 1,024: ~2 x the passes)
    assert max(per_token.values()) <= 2, per_token


def test_the_shared_prefix_is_still_measured_for_a_log_that_is_written():
    with capture_logs() as logs:
        eng, other, req = _engine(), *(Request(list(range(1, 81)) + [k], SamplingParams(max_tokens=1)) for k in (1, 2))
        other.state = RequestState.PREFILL
        eng.running.append(other)
        assert eng.admission._computes_prefix_of(req) is other
        assert eng.admission._computes_prefix_of(req) is other  # (logged once)
    waits = [e for e in logs if e.get("state") == "prefill_waits"]
    assert [(e["behind"], e["shared_tokens"], e["published_tokens"]) for e in waits] == [(other.rid, 80, 0)]


def _whole_comparison(eng: Engine, req: Request) -> Request | None:
    """The check as it was: the whole reusable prefix against each request in prefill (the decision only)."""
    tokens = eng.admission._reusable(req)
    if len(tokens) < PREFILL_SHARE_MIN_TOKENS:
        return None
    for other in eng.running:
        if other.state is not RequestState.PREFILL:
            continue
        need = other.cached_len + PREFILL_SHARE_MIN_TOKENS
        need += -need % PAGE
        theirs = other.cache_prompt
        if need <= min(len(tokens), len(theirs)) and tokens[:need] == theirs[:need]:
            return other
    return None


def test_the_waits_are_those_of_a_whole_comparison_on_random_prompts():
    """Remembering what a check compared changes no decision: random prompts sharing random prefixes, sharers whose
    prefill grows, restarts (a preemption) or ends, queued requests preempted (their output folded in), salted."""
    rng = random.Random(76)
    for trial in range(40):
        eng = _engine()
        base = [rng.randrange(1, 50) for _ in range(200)]

        def prompt() -> list[int]:
            keep = rng.randrange(0, 200)
            return base[:keep] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 120))]

        sharers = [Request(prompt(), SamplingParams(max_tokens=1)) for _ in range(rng.randrange(1, 4))]
        for other in sharers:
            other.state = RequestState.PREFILL
            eng.running.append(other)
        queued = []
        for _ in range(6):
            salt = rng.choice([None, None, "tenant"])
            req = Request(prompt(), SamplingParams(max_tokens=8, cache_salt=salt,
                                                   prompt_logprobs=rng.choice([None, None, 1])))
            queued.append(req)
        for other in sharers:
            if rng.random() < 0.3:
                other.params = SamplingParams(max_tokens=1, cache_salt="tenant")
        for _ in range(30):
            for other in sharers:
                roll = rng.random()
                if roll < 0.1:
                    other.cached_len = 0  # preempted and admitted again
                elif roll < 0.2:
                    other.state = RequestState.DECODE if other.state is RequestState.PREFILL else RequestState.PREFILL
                else:
                    other.cached_len += rng.choice([0, 4, 8, 16, 33])
            for req in queued:
                if rng.random() < 0.05:  # preempted: its output so far is folded into its next prefill
                    req.output += [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))]
                    req.resumed_tokens = len(req.output)
                want = _whole_comparison(eng, req)
                assert eng.admission._computes_prefix_of(req) is want, (trial, req.rid)

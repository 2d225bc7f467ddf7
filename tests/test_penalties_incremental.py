"""Penalties (and logit_bias) kept per request on the device across its steps (scheduler/penalty_state.py):
each step equals the from-scratch formula (the reference below is the former `apply_penalties`, which
rebuilt every row's counts from its whole history each step), over many steps with growing outputs,
mixed rows, chained in-flight ids, an output that shrinks, rows that join late; and a step uploads the
rows' new tokens, not their history."""
from __future__ import annotations

import random

import torch

from scheduler.penalty_state import PenaltyState, RowPenalties, apply_penalties, step_upload

VOCAB = 48  # small: tokens repeat, so counts above 1 and prompt/output overlaps are common


def from_scratch(logits: torch.Tensor, rows: list[RowPenalties | None],
                 inflight_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The former implementation: every row's counts built from its whole prompt and output each step
    (with the bias added first, as vLLM V1 does)."""
    out = logits.to(torch.float32, copy=True)
    for i, r in enumerate(rows):
        for t, v in (r.logit_bias or {}).items() if r is not None else ():
            out[i, t] += torch.tensor(v, dtype=torch.float32)
    asking = [i for i, r in enumerate(rows) if r is not None and r.penalized]
    if not asking:
        return out
    n, vocab = len(asking), logits.shape[-1]
    prompts = [rows[i].prompt_ids if rows[i].repetition != 1.0 else [] for i in asking]
    out_rows = torch.tensor([j for j, i in enumerate(asking) for _ in rows[i].output_ids], dtype=torch.int64)
    out_ids = torch.tensor([t for i in asking for t in rows[i].output_ids], dtype=torch.int64)
    prompt_rows = torch.tensor([j for j, p in enumerate(prompts) for _ in p], dtype=torch.int64)
    prompt_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    rows_t = torch.tensor(asking, dtype=torch.int64)
    weights = torch.tensor([[rows[i].presence, rows[i].frequency, rows[i].repetition] for i in asking],
                           dtype=torch.float32)
    counts = torch.zeros((n, vocab), dtype=torch.float32)
    counts.index_put_((out_rows, out_ids), torch.ones(len(out_ids)), accumulate=True)
    if inflight_ids is not None:
        counts.index_put_((torch.arange(n), inflight_ids.index_select(0, rows_t)), torch.ones(n), accumulate=True)
    generated = counts > 0
    seen = generated.index_put((prompt_rows, prompt_ids), torch.ones(len(prompt_ids), dtype=torch.bool))
    x = out.index_select(0, rows_t)
    repetition = weights[:, 2:3]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - weights[:, 1:2] * counts - weights[:, 0:1] * generated
    return out.index_copy_(0, rows_t, x)


class FakeRequest:
    """What step_extras.ask reads of a Request: its parameters, prompt, output and state."""

    def __init__(self, rng: random.Random, presence=0.0, frequency=0.0, repetition=1.0, bias=None,
                 prompt_tokens=12) -> None:
        self.weights = (presence, frequency, repetition)
        self.bias = bias
        self.prompt = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
        self.output: list[int] = []
        self.state = PenaltyState()

    def row(self) -> RowPenalties:
        return RowPenalties(*self.weights, self.prompt, self.output, self.state, self.bias)


def kinds(rng: random.Random) -> list[FakeRequest | None]:
    """Mixed rows: none, repetition only, presence/frequency only, all three, a bias only, a bias and penalties."""
    return [None,
            FakeRequest(rng, repetition=1.7),
            FakeRequest(rng, presence=0.8, frequency=0.3),
            None,
            FakeRequest(rng, presence=-0.5, frequency=1.2, repetition=0.6),
            FakeRequest(rng, bias={3: -100.0, 7: 2.5, 40: 100.0}),
            FakeRequest(rng, frequency=2.0, repetition=1.3, bias={3: 5.0, 11: -1.0})]


def step_and_check(reqs: list[FakeRequest | None], rng: random.Random, chained: bool) -> None:
    rows = [None if r is None else r.row() for r in reqs]
    logits = torch.randn(len(rows), VOCAB) * 3
    logits[0, 5] = float("nan")  # a NaN logit stays NaN in both
    inflight = torch.tensor([rng.randrange(VOCAB) for _ in rows]) if chained else None
    want = from_scratch(logits, rows, inflight)
    got = apply_penalties(logits, rows, inflight)
    assert got.dtype == torch.float32 and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())  # exactly: the same float32 operations
    assert torch.equal(logits.isnan().sum(), torch.tensor(1))  # the raw logits are left alone


def test_many_steps_equal_the_from_scratch_formula_with_rows_joining_and_an_output_shrinking():
    rng = random.Random(0)
    torch.manual_seed(0)
    reqs = kinds(rng)
    late = FakeRequest(rng, presence=1.0, repetition=1.9, prompt_tokens=30)
    for step in range(60):
        if step == 20:  # a row joins mid-way (its first step uploads its history and prompt once)
            late.output.extend(rng.randrange(VOCAB) for _ in range(9))
            reqs.append(late)
        if step == 35:  # an output shorter than what was counted: its counts are built again
            reqs[4].output[:] = reqs[4].output[:5]
            reqs[2].output.clear()
        # a chained step's in-flight token is never the host's: it must not stay in the counts
        step_and_check(reqs, rng, chained=step % 3 != 0)
        assert all(r.state.counted == len(r.output) for r in reqs if r is not None and r.row().penalized)
        for r in reqs:
            if r is not None:  # mostly one token a step; sometimes none (a prefill chunk), sometimes several
                r.output.extend(rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 1, 0, 3])))


def test_counts_stay_the_hosts_and_masks_are_built_once():
    rng = random.Random(1)
    req = FakeRequest(rng, frequency=1.0, repetition=2.0)
    for step in range(5):
        apply_penalties(torch.randn(1, VOCAB), [req.row()], torch.tensor([7]))  # chained: 7 in flight
        if step == 0:
            mask = req.state.prompt_seen
        assert req.state.prompt_seen is mask  # the prompt's mask: built at its first step only
        assert req.state.counted == len(req.output)
        want = torch.zeros(VOCAB).index_put_((torch.tensor(req.output, dtype=torch.int64),),
                                             torch.ones(len(req.output)), accumulate=True)
        assert torch.equal(req.state.counts, want)  # the in-flight 7 is not counted in the state
        req.output.append(7)


def test_a_step_uploads_the_new_tokens_not_the_history():
    """Regression: every step copied each row's whole output (and, with repetition, its prompt) to the
    device: linear in the context on the host, each step."""
    rng = random.Random(2)
    reqs = [FakeRequest(rng, repetition=1.2, prompt_tokens=800), FakeRequest(rng, presence=0.5),
            FakeRequest(rng, frequency=0.5, bias={i: 1.0 for i in range(40)}), None]
    first = step_upload([None if r is None else r.row() for r in reqs])
    assert len(first.index) >= 800 + 40  # the prompt (mask) and the bias, once
    sizes = []
    for step in range(300):
        rows = [None if r is None else r.row() for r in reqs]
        up = step_upload(rows)
        if step == 1:  # the 50 tokens its first step left
            assert up.index_sizes[1] == 3 * 50
        if step > 1:
            sizes.append(len(up.index))
            # penalized rows, (row, id) of one new token each, the biased row and its size
            assert len(up.index) == 3 + 2 * 3 + 2, up.index_sizes
            assert len(up.values) == 3 * 3  # the weights; the bias' values went up once
        apply_penalties(torch.randn(len(rows), VOCAB), rows)
        for r in reqs:
            if r is not None:
                r.output.extend(rng.randrange(VOCAB) for _ in range(1 if step > 0 else 50))
    assert max(sizes) == min(sizes)  # flat while the outputs grew to 350 tokens


def test_nothing_runs_for_a_batch_of_rows_that_do_not_ask():
    logits = torch.randn(3, VOCAB)
    rng = random.Random(3)
    neutral = FakeRequest(rng)  # all neutral: a row that asks for nothing (ask() gives None for it)
    up = step_upload([None, neutral.row(), None])
    assert up.penalized == [] and up.biased == [] and len(up.index) == 0
    assert torch.equal(apply_penalties(logits, [None, neutral.row(), None]), logits)
    assert neutral.state.counts is None and neutral.state.bias_ids is None


def test_a_kept_bias_is_the_one_uploaded_even_if_the_dict_changes():
    """Regression: a step took a kept bias' size from the live logit_bias dict: a dict that grew after
    its first step split the kept ids at the wrong size (a shape error on the step). The state's bias is
    the one applied from its first step on."""
    rng = random.Random(4)
    req = FakeRequest(rng, bias={3: 4.0, 9: -2.0})
    kept = dict(req.bias)
    apply_penalties(torch.randn(1, VOCAB), [req.row()])
    req.bias[20] = 100.0  # after the first step
    logits = torch.randn(2, VOCAB)
    other = FakeRequest(rng, bias={5: 1.0})
    got = apply_penalties(logits, [req.row(), other.row()])
    want = logits.clone()
    for t, v in kept.items():
        want[0, t] += v
    want[1, 5] += 1.0
    assert torch.equal(got, want)


def test_a_request_failed_by_the_crash_fallback_frees_its_device_state():
    """Regression: when finishing a request failed after the loop crashed, the fallback ended it FAILED
    but kept its penalty state (device tensors held as long as the Request object)."""
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.loop_task import fail_live_requests
    from scheduler.request import Request, RequestState, SamplingParams

    eng = Engine(EngineConfig(model="tiny", device="cpu", num_pages=64))
    req = Request([1, 2, 3], SamplingParams(max_tokens=4, presence_penalty=0.5))
    req.penalty_state = PenaltyState()
    req.penalty_state.counts = torch.zeros(VOCAB)
    eng.requests[req.rid] = req
    eng.running.append(req)

    def broken_finish(*args, **kwargs):
        raise RuntimeError("finish broke too")

    eng.finish = broken_finish
    fail_live_requests(eng, RuntimeError("loop crashed"))
    assert req.state == RequestState.FAILED and req.finish_reason == "error"
    assert req.penalty_state is None and not eng.requests and req not in eng.running

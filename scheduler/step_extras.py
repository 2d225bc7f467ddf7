"""What a step computes beside its tokens for the requests that ask: logprobs, and penalties with logit_bias.
A batch where no request asks gets neither: no extra kernel, no extra copy (scheduler/runner.py reads
`BatchInput.logprobs` / `BatchInput.penalties`, None then). Used by the engine's loop
(scheduler/engine.py); docs/design.md, "Overlap scheduling", says how both meet chained decode."""
from __future__ import annotations

from scheduler.penalty_state import PenaltyState, RowPenalties
from scheduler.request import Request, RequestError, SamplingParams
from scheduler.runner import BatchInput, StepHandle

_NEUTRAL_PENALTIES = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))


def refuse_without_logits(params: SamplingParams) -> None:
    """A simulated engine (--simulate) has no logits: a request asking for logprobs, penalties or a
    logit_bias is refused, naming the field."""
    if params.logprobs is not None:
        raise RequestError("logprobs need the model's logits: a simulated engine (--simulate) has none", "logprobs")
    if params.penalized:
        name = next(n for n, off in _NEUTRAL_PENALTIES if getattr(params, n) != off)
        raise RequestError("penalties need the model's logits: a simulated engine (--simulate) has none", name)
    if params.logit_bias:
        raise RequestError("logit_bias needs the model's logits: a simulated engine (--simulate) has none",
                           "logit_bias")


def ask(reqs: list[Request], binput: BatchInput) -> None:
    """Fill the batch's logprobs and penalties (with logit_bias) inputs where one of its requests wants
    them. A penalized row's ids are the host's at launch (the runner uploads those its request's state
    has not counted): a chained step's newest token is still on the device, and the runner counts it
    from there (`penalty_state.apply_penalties`)."""
    if any(r.params.logprobs is not None for r in reqs):
        binput.logprobs = [r.params.logprobs for r in reqs]
    if any(r.params.adjusts_logits for r in reqs):
        binput.penalties = [_row(r) if r.params.adjusts_logits else None for r in reqs]


def _row(req: Request) -> RowPenalties:
    if req.penalty_state is None:  # its first step that asks: the runner fills it on the logits' device
        req.penalty_state = PenaltyState()
    p = req.params
    return RowPenalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty, req.prompt, req.output,
                        req.penalty_state, p.logit_bias)


def keep_logprobs(runner, reqs: list[Request], binput: BatchInput, handle: StepHandle, next_ids: list[int]) -> None:
    """After `collect`: each asking request's logprobs of that step, kept with their token until it is
    emitted (Request.emit; an overlapped restore's forward may be applied later)."""
    lps = runner.logprobs_of(handle, binput.logprobs)
    if lps is not None:
        for req, token, lp in zip(reqs, next_ids, lps):
            if lp is not None:
                req.step_logprobs = (token, lp)

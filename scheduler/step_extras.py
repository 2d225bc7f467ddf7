"""What a step computes beside its tokens for the requests that ask: logprobs (of its tokens, and of a
prefill chunk's prompt tokens), penalties with logit_bias and min_tokens' stop ids, token bans (allowed_token_ids,
bad words: scheduler/token_bans.py) and guided rows' masks. A batch where no request asks gets neither: no extra
kernel, no extra copy (scheduler/runner.py reads `BatchInput.logprobs` / `BatchInput.prompt_logprobs` /
`BatchInput.penalties` / `BatchInput.bans`, None then). Used by the engine's loop
(scheduler/engine_loop.py); docs/design.md, "Overlap scheduling", says how both meet chained decode."""
from __future__ import annotations

import torch

from scheduler.guided import fill_masks, fill_verify_masks
from scheduler.penalty_state import PenaltyState, RowPenalties
from scheduler.request import Request, RequestError, RequestState, SamplingParams
from scheduler.runner import BatchInput, StepHandle
from scheduler.speculative import row_starts
from scheduler.token_bans import RowBans, held_by_min_tokens, nothing_left

_NEUTRAL_PENALTIES = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))


def refuse_without_logits(params: SamplingParams) -> None:
    """A simulated engine (--simulate) has no logits: a request asking for logprobs, penalties, a
    logit_bias, min_tokens (whose stop ids are masked on the logits) or token bans is refused, naming the field."""
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            raise RequestError(f"{name} need the model's logits: a simulated engine (--simulate) has none", name)
    if params.penalized:
        name = next(n for n, off in _NEUTRAL_PENALTIES if getattr(params, n) != off)
        raise RequestError("penalties need the model's logits: a simulated engine (--simulate) has none", name)
    if params.guided is not None:
        raise RequestError("structured outputs mask the model's logits: a simulated engine (--simulate) has none",
                           "guided")
    if params.logit_bias:
        raise RequestError("logit_bias needs the model's logits: a simulated engine (--simulate) has none",
                           "logit_bias")
    if params.min_tokens:
        raise RequestError("min_tokens masks stop ids on the model's logits: a simulated engine (--simulate) "
                           "has none", "min_tokens")
    for name in ("allowed_token_ids", "bad_words_token_ids"):
        if getattr(params, name):
            raise RequestError(f"{name} bans tokens on the model's logits: a simulated engine (--simulate) has none",
                               name)


def ask(reqs: list[Request], binput: BatchInput, eos_ids: tuple[int, ...] = ()) -> None:
    """Fill the batch's logprobs (a prefill chunk's prompt logprobs too) and penalties (with logit_bias and
    min_tokens) inputs where one of its requests wants them. A penalized row's ids are the host's at launch
    (the runner uploads those its request's state has not counted): a chained step's newest token is still on
    the device, and the runner counts it from there (`penalty_state.apply_penalties`). eos_ids: the model's,
    which min_tokens holds back unless a request ignores EOS, or its grammar allows nothing else (guided rows'
    masks: scheduler/guided.py)."""
    # (a row whose request ended, `ask_or_fail`'s culprit or one stopped at the step before, asks no logprobs
    # either: regression, its prompt logprobs were read, and a raise reading them failed the step's other askers,
    # or crashed the loop where it had none)
    if any(r.params.logprobs is not None and not r.state.done for r in reqs):
        binput.logprobs = [None if r.state.done else r.params.logprobs for r in reqs]
    if not binput.is_decode and any(r.params.prompt_logprobs is not None and not r.state.done for r in reqs):
        # a chunk's row at position p gives the logprobs of prompt token p + 1 (the last prompt row samples)
        targets = [r.prompt[start + 1:start + new + 1]
                   if r.params.prompt_logprobs is not None and not r.resumed_tokens and not r.state.done
                   else []  # (a preempted request's resumption: its prompt's were all computed)
                   for r, start, new in zip(reqs, binput.prefix_lens, binput.new_lens)]
        if any(targets):
            binput.prompt_logprobs = [(r.params.prompt_logprobs, t) if t else None for r, t in zip(reqs, targets)]
    # a deferred step's row whose request ended at the step before (its token is dropped: `after_step`) asks
    # nothing (regression: its mask made from a stopped or errored matcher, and a PenaltyState made anew after
    # `finish` had dropped it, its tensors then kept on the device with the Request)
    adjusts = [r.params.adjusts_logits and not r.state.done for r in reqs]
    held = [() if r.state.done else _held_stops(r, eos_ids) for r in reqs]
    rows = [i for i, r in enumerate(reqs) if r.guide is not None and not r.state.done]
    unheld: dict[int, frozenset[int]] = {}  # a verify step's rows whose grammar allows only the held stop ids
    if rows and binput.verify_drafts is not None:  # a verify step's: each guided sequence's every row, packed
        unheld = _verify_masks(reqs, binput, rows, held)
    elif rows:  # (each row's from its grammar's state after its last token)
        masks = torch.empty(len(rows), reqs[rows[0]].guide.words, dtype=torch.int32)  # [R, words]
        for i, fit in zip(rows, fill_masks([reqs[i].guide for i in rows], masks, [held[i] for i in rows])):
            if not fit:
                # its grammar allows only stop ids min_tokens holds: the grammar wins (regression: every allowed
                # token at -inf, a row of -inf sampled, the request failed)
                held[i] = ()
        binput.token_masks = (rows, masks)
    if any(adjusts) or any(held):  # (min_tokens with nothing left to mask asks nothing)
        binput.penalties = [_row(r, h, unheld.get(i, frozenset())) if a or h else None
                            for i, (r, a, h) in enumerate(zip(reqs, adjusts, held))]
    if any(bans := [r.params.restricts_tokens and not r.state.done for r in reqs]):  # (scheduler/token_bans.py)
        binput.bans = [RowBans(r.params.allowed_token_ids, r.params.bad_words_token_ids, r.output, _state(r))
                       if b else None for r, b in zip(reqs, bans)]


def ask_or_fail(engine, work) -> None:
    """`ask` for a Batch, where a raise of one request's own inputs (its grammar's mask: a matcher's bug in
    llguidance; its penalties', logit_bias', min_tokens' or bans' rows) fails that request alone
    (Engine.fail_own_work) and the step is asked again without it: a done row asks nothing, and its token is dropped
    (`after_step`). The culprit is found by asking each request alone, on this failure path only; a raise that no
    request makes alone (the batch's own) goes out, and crashes the loop (regression: any such raise did, and
    every live request failed with it)."""
    reqs, _, binput = work
    eos_ids = engine.model_config.eos_token_ids
    try:
        ask(reqs, binput, eos_ids)
        return
    except Exception:
        culprits = [(r, e) for i, r in enumerate(reqs) if not r.state.done
                    and (e := _ask_alone(r, i, binput, eos_ids)) is not None]
        if not culprits:
            raise
    for req, exc in culprits:
        engine.fail_own_work(req, f"making this request's step inputs ({', '.join(_asks(req)) or 'none'})", exc)
    binput.logprobs = binput.prompt_logprobs = binput.penalties = binput.bans = binput.token_masks = None
    ask(reqs, binput, eos_ids)


def _ask_alone(req: Request, i: int, binput: BatchInput, eos_ids: tuple[int, ...]) -> Exception | None:
    """What `ask` raises for row i's request alone (a probe BatchInput of that row), or None."""
    probe = BatchInput(prefix_lens=[binput.prefix_lens[i]], new_lens=[binput.new_lens[i]], is_decode=binput.is_decode,
                       verify_drafts=None if binput.verify_drafts is None else [binput.verify_drafts[i]])
    try:
        ask([req], probe, eos_ids)
    except Exception as exc:
        return exc
    return None


def _asks(req: Request) -> list[str]:
    """What a request's step inputs hold beside its tokens (named in its error when making them raised)."""
    p = req.params
    return [name for name, on in (("grammar mask", req.guide is not None), ("penalties", p.penalized),
                                  ("logit_bias", bool(p.logit_bias)), ("min_tokens", bool(p.min_tokens)),
                                  ("token bans", p.restricts_tokens), ("logprobs", p.logprobs is not None),
                                  ("prompt logprobs", p.prompt_logprobs is not None)) if on]


def _verify_masks(reqs: list[Request], binput: BatchInput, guided: list[int],
                  held: list[tuple[int, ...]]) -> dict[int, frozenset[int]]:
    """A verify step's guided masks (scheduler/guided.py fill_verify_masks): its rows counted as if packed (sequence
    b's new_lens[b] rows right after the sequence before's; the runner places them in its graph's layout). held:
    each request's stop ids min_tokens may mask; row j holds them while its token is one of the first min_tokens.
    Returns, per guided request with such a row, the rows whose grammar allows nothing else (not held there)."""
    drafts = [binput.verify_drafts[i] for i in guided]
    masks = torch.zeros(sum(len(d) + 1 for d in drafts), reqs[guided[0]].guide.words, dtype=torch.int32)  # [R, W]
    row_held = [[held[i] if len(reqs[i].output) + j < reqs[i].params.min_tokens else () for j in range(len(d) + 1)]
                for i, d in zip(guided, drafts)]
    fits = fill_verify_masks([reqs[i].guide for i in guided], drafts, masks, row_held)
    starts = row_starts(binput.new_lens, 0)
    binput.token_masks = ([starts[i] + j for i in guided for j in range(binput.new_lens[i])], masks)
    return {i: frozenset(j for j, ok in enumerate(fit) if not ok) for i, fit in zip(guided, fits) if not all(fit)}


def _held_stops(req: Request, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids min_tokens may still mask for it: () once it has min_tokens tokens (then its rows ask
    nothing for it; a chained step may be one token past that, `RowPenalties.holds_stops`)."""
    p = req.params
    if len(req.output) >= p.min_tokens:
        return ()
    # (the EOS ids with ignore_eos too, as vLLM's min_tokens holds all its stop ids: regression, EOS came first)
    held = tuple(dict.fromkeys((*p.stop_token_ids, *eos_ids)))
    # allowed_token_ids that leave only those ids: the restriction wins (regression: a row of -inf sampled token 0)
    return () if held_by_min_tokens(p.allowed_token_ids, p.bad_words_token_ids, held) else held


def _state(req: Request) -> PenaltyState:
    if req.penalty_state is None:  # its first step that asks: the runner fills it on the logits' device
        req.penalty_state = PenaltyState()
    return req.penalty_state


def _row(req: Request, held_stops: tuple[int, ...], unheld_rows: frozenset[int] = frozenset()) -> RowPenalties:
    p = req.params
    return RowPenalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty, req.prompt, req.output,
                        _state(req), p.logit_bias, p.min_tokens, held_stops, unheld_rows=unheld_rows)


def keep_logprobs(engine, reqs: list[Request], binput: BatchInput, handle: StepHandle, next_ids: list[int]) -> None:
    """After `collect`: each asking request's logprobs of that step, kept with their token until it is
    emitted (Request.emit; an overlapped restore's forward may be applied later); a prefill chunk's
    prompt logprobs, added to its request's."""
    runner = engine.runner
    if binput.verify_drafts is not None:  # next_ids: per sequence, its rows' tokens
        _keep_verify_logprobs(engine, reqs, binput, handle, next_ids)
        return
    lps = _logprobs_or_fail(engine, reqs, handle, binput.logprobs, [[i] for i in range(len(reqs))])
    if lps is not None:
        for req, token, lp in zip(reqs, next_ids, lps):
            if lp is not None:
                req.step_logprobs = [(token, lp)]
    if binput.is_decode:
        return
    try:
        prompt_lps = runner.prompt_logprobs_of(handle, binput.prompt_logprobs) or [None] * len(reqs)
    except Exception as exc:  # (read as a whole, one row's fitting the others' by position: those that asked fail,
        # the others go on; regression: the loop crashed, every live request failed with it)
        asked = [r for r, want in zip(reqs, binput.prompt_logprobs or ()) if want is not None]
        if not asked:
            raise  # (a raise no request asked for: the batch's own bug goes out)
        askers = [r for r in asked if not r.state.done]
        if not askers:  # those that asked ended since the launch (failed reading their logprobs, above): the rows are
            return  # no one's (regression: the raise went out, and the loop crashed with every other request)
        for req in askers:
            engine.fail_own_work(req, "reading this step's prompt logprobs", exc)
        return
    for req, start, lp in zip(reqs, binput.prefix_lens, prompt_lps):
        if req.params.prompt_logprobs is not None and not req.resumed_tokens and not req.state.done:  # (a
            # preempted one's are all there; one ended asked none: `ask`)
            if start == 0:  # its first chunk (its prompt is computed whole, from position 0: Admission._reusable)
                req.prompt_logprobs = [None]
            req.prompt_logprobs += lp or []


def _logprobs_or_fail(engine, reqs: list[Request], handle: StepHandle, wants: list[int | None] | None,
                      rows: list[list[int]]) -> list | None:
    """`runner.logprobs_of(handle, wants)`; where it raises, each asking request's rows (rows[i], of reqs[i]) are
    read alone, a request whose rows raise alone fails (Engine.fail_own_work), and the others' are read without
    them (a row's are its own: `unpack_logprobs`). A raise no request's rows make alone goes out (regression: any
    such raise crashed the loop). Prompt logprobs are read as a whole (one row's fit the others' by position).
    The rows of a request that ended before its step's tokens came (at the step before a chained step, or by its
    own inputs: `ask_or_fail`) are no one's and are not read (regression: a raise reading them, found in no live
    request's rows, crashed the loop)."""
    if wants is not None and any(req.state.done for req in reqs):
        wants = list(wants)
        for req, own in zip(reqs, rows):
            if req.state.done:
                for j in own:
                    wants[j] = None
    try:
        return engine.runner.logprobs_of(handle, wants)
    except Exception:
        culprits = []
        for req, own in zip(reqs, rows):
            if not req.state.done and any(wants[j] is not None for j in own):
                try:
                    engine.runner.logprobs_of(handle, [w if j in own else None for j, w in enumerate(wants)])
                except Exception as exc:
                    culprits.append((req, own, exc))
        if not culprits:
            raise
    wants = list(wants)
    for req, own, exc in culprits:
        engine.fail_own_work(req, "reading this request's logprobs", exc)
        for j in own:
            wants[j] = None
    return engine.runner.logprobs_of(handle, wants)


def _keep_verify_logprobs(engine, reqs: list[Request], binput: BatchInput, handle: StepHandle,
                          tokens: list[list[int]]) -> None:
    """A verify step's logprobs: per asking request, each of its rows' token with its logprobs, in order (`emit`
    takes those of the tokens the step yields: the accepted drafts, then the row after them). Sequence b's rows
    start at b * handle.row_stride, or packed (stride 0)."""
    if binput.logprobs is None:
        return
    stride, new_lens = handle.row_stride, binput.new_lens
    wants: list[int | None] = [None] * (stride * len(new_lens) if stride else sum(new_lens))  # per row of the logits
    starts = row_starts(new_lens, stride)
    for start, want, n in zip(starts, binput.logprobs, new_lens):
        wants[start:start + n] = [want] * n
    lps = _logprobs_or_fail(engine, reqs, handle, wants, [list(range(s, s + n)) for s, n in zip(starts, new_lens)])
    for req, want, start, rows in zip(reqs, binput.logprobs, starts, tokens):
        if want is not None and not req.state.done:
            req.step_logprobs = list(zip(rows, lps[start:start + len(rows)]))


def fail_broken_bans(engine, work, next_ids: list[int]) -> None:
    """After `collect`, before its tokens are taken (Engine._after_batch): each request whose token this step is
    one its allowed_token_ids or bad words ban (`RowBans.sampled_banned`: its row had no token left) fails,
    naming them. Regression: that token (argmax's 0, outside the allowed ids) was streamed, and decode went on."""
    reqs, chunks, binput = work
    if binput.bans is None:
        return
    for req, chunk, row, token in zip(reqs, chunks, binput.bans, next_ids):
        if row is None or req.state.done or token < 0 or req.cached_len + chunk < req.prefill_len:
            continue  # (a NaN mark; a prefill chunk before the last: its token is thrown away)
        fail_if_banned(engine, req, row, token)


def fail_if_banned(engine, req: Request, row: RowBans, token: int) -> bool:
    """Fail `req` if `token`, its next, is one its bans ban (its row had no token left); -> whether it did. A verify
    step asks this of each token it yields, before that token is taken (scheduler/speculative.py after_verify).
    A raise as its bans judge it fails it alone (Engine.fail_own_work; regression: the loop crashed)."""
    try:
        banned = row.sampled_banned(token)
    except Exception as exc:
        engine.fail_own_work(req, "checking this request's token against its token bans", exc)
        return True
    if not banned:
        return False
    engine.finish(req, RequestState.FAILED, "error", nothing_left(req))
    return True


def guide_takes(engine, req: Request, token: int) -> bool | None:
    """`req`'s grammar takes its step's `token` -> whether the answer is whole with it (`Guide.complete`), or
    None where the request ended here. A raise of its matcher (a bug of llguidance's on an odd grammar) fails
    it alone (Engine.fail_own_work; regression: the loop crashed, and every live request failed with it)."""
    try:
        if req.guide.allows_none:  # (its mask was empty: this token is no answer's)
            error = req.guide.stuck_error()  # (None: whole, only an EOS the model lacks could follow)
            ended = (RequestState.FAILED, "error", error) if error else (RequestState.FINISHED, "stop", None)
        elif (broken := req.guide.accept(token)) is not None:
            # a grammar's mask holds every token it refuses, so a token it refuses was sampled from a row that had
            # none left: the bans' doing where there are any (regression: an arbitrary token was named as breaking
            # the grammar), else llguidance gave up on the grammar (one too ambiguous) or the row was NaN
            ended = (RequestState.FAILED, "error", nothing_left(req) if req.params.restricts_tokens
                     else f"the token sampled broke the request's grammar: {broken}")
        else:
            return req.guide.complete
    except Exception as exc:
        engine.fail_own_work(req, "advancing this request's grammar by its token", exc)
        return None
    engine.finish(req, *ended)
    return None

"""Penalties, logit_bias and min_tokens on the device, as vLLM V1 applies them: a row's bias added to its
logits, then repetition over the prompt's and generated tokens, then frequency and presence over the
generated ones, then its stop ids at -inf while min_tokens holds them back, on a float32 copy (logprobs
and NaN marks read the raw logits; scheduler/runner.py).

A request keeps its inputs on the device across its steps (`PenaltyState`, Request.penalty_state): the
counts of the generated tokens the host has counted so far, its prompt's tokens as a mask (repetition
only, built once), its bias (uploaded once). A step uploads, for all its rows at once, only what the
states lack (`step_upload`): a decode step's new tokens, not each row's whole history (that was a
Python list of every generated and prompt token of every row, and a [n, V] count matrix rebuilt from
it, each step: milliseconds at 32 rows of 4,000 tokens, as long as the step itself)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class PenaltyState:
    """One request's penalty and bias inputs on the device (and its token bans' mask: scheduler/token_bans.py):
    made empty by the host (step_extras.ask), its tensors on the logits' device at its first step that asks;
    freed with the request."""
    __slots__ = ("counts", "counted", "prompt_seen", "bias_ids", "bias_values", "banned", "words")

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None       # [V] float32: each token's count in output[:counted]
        self.counted = 0                               # generated tokens in `counts` (the host's, never an
                                                       # in-flight one: a chained step's is added per step)
        self.prompt_seen: torch.Tensor | None = None  # [V] bool: the prompt's tokens (repetition only)
        self.bias_ids: torch.Tensor | None = None     # [k] int64: logit_bias' token ids
        self.bias_values: torch.Tensor | None = None  # [k] float32: their biases
        self.banned: torch.Tensor | None = None       # [V] bool: tokens outside allowed_token_ids, one-token bad words
        self.words = None  # its longer bad words, prepared once (scheduler/token_bans.py WordIndex)


class RowPenalties(NamedTuple):
    """A batch row's inputs (SamplingParams' penalties and logit_bias), for a row whose request asks."""
    presence: float
    frequency: float
    repetition: float
    prompt_ids: list[int]   # the prompt's tokens: read once, when its state builds the mask (repetition only)
    output_ids: list[int]   # its generated tokens the host has (a chained step's newest is on the device):
                            # only those past state.counted are read
    state: PenaltyState     # the request's, kept across its steps
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0     # its stop ids are masked while this step's token is one of its first min_tokens
    stop_ids: tuple[int, ...] = ()  # those ids (stop_token_ids and the EOS ids, with ignore_eos too); ()
                                    # once past min_tokens
    draft_ids: tuple[int, ...] = ()  # a verify row's drafts before it (scheduler/speculative.py): generated
                                     # tokens of this row only, counted in the step's copy, never in the state
    # a verify step's rows (j) whose stop ids are not held: their grammar allows nothing else there (a grammar
    # wins over min_tokens, as in a plain step: step_extras.ask)
    unheld_rows: frozenset[int] = frozenset()

    @property
    def penalized(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0

    def holds_stops(self, chained: bool) -> bool:
        """Whether this step masks its stop ids: its token's index is the host's count of generated
        tokens, plus one in a chained step (the token in flight; regression test: without it the mask
        held one step past min_tokens), plus a verify row's drafts before it. A non-final prompt chunk's
        token is thrown away: masking it changes nothing."""
        return bool(self.stop_ids) and len(self.output_ids) + chained + len(self.draft_ids) < self.min_tokens


class StepUpload(NamedTuple):
    """What a step copies to the device: one int64 tensor and one float32 tensor (on the host), in parts."""
    index: torch.Tensor    # int64: penalized rows [p], new tokens' (row, id) [u] + [u], new masks' prompt ids [q],
                           # biased rows [b], their bias sizes [b], new biases' ids [c], held stop ids' (row, id)
                           # [s] + [s], verify rows' drafts' (row, id) [d] + [d]
    values: torch.Tensor   # float32: the penalized rows' (presence, frequency, repetition) [p * 3], new biases [c]
    index_sizes: list[int]
    penalized: list[int]   # batch rows (their order in the step's [p, V] matrices)
    recount: list[int]     # positions in `penalized` whose counts start again from 0 (a first step, or an
                           # output shorter than what was counted)
    new_masks: list[int]   # positions in `penalized` whose prompt mask is built this step
    mask_sizes: list[int]  # their prompts' lengths
    biased: list[int]      # batch rows
    new_biases: list[int]  # positions in `biased` whose bias is uploaded this step
    bias_sizes: list[int]  # each biased row's number of ids
    held_stops: int = 0    # (row, id) pairs masked this step (min_tokens)


def step_upload(rows: list[RowPenalties | None], vocab_size: int | None = None, chained: bool = False) -> StepUpload:
    """The host's side of a step: its rows' inputs that their states lack. Its size is the batch's rows
    plus their tokens generated since their last step (and, once per request, its prompt and bias), plus
    the stop ids min_tokens holds back (a few per row, for its first min_tokens steps). Stop ids outside
    [0, vocab_size) are never sampled: left out (a negative index_put index counts from the end)."""
    penalized = [i for i, r in enumerate(rows) if r is not None and r.penalized]
    new_rows, new_ids, prompt_ids, recount, new_masks, mask_sizes = [], [], [], [], [], []
    for j, i in enumerate(penalized):
        row, state = rows[i], rows[i].state
        start = state.counted
        if state.counts is None or len(row.output_ids) < start:
            recount.append(j)
            start = 0
        new = row.output_ids[start:]
        new_rows += [j] * len(new)
        new_ids += new
        if row.repetition != 1.0 and state.prompt_seen is None:
            new_masks.append(j)
            mask_sizes.append(len(row.prompt_ids))
            prompt_ids += row.prompt_ids
    biased = [i for i, r in enumerate(rows) if r is not None and r.logit_bias]
    new_biases = [j for j, i in enumerate(biased) if rows[i].state.bias_ids is None]
    # a kept bias' size is its state's (what the device holds), not the live dict's
    bias_sizes = [len(rows[i].logit_bias) if rows[i].state.bias_ids is None else rows[i].state.bias_ids.numel()
                  for i in biased]
    bias_ids = [t for j in new_biases for t in rows[biased[j]].logit_bias]
    bias_values = [v for j in new_biases for v in rows[biased[j]].logit_bias.values()]
    weights = [w for i in penalized for w in (rows[i].presence, rows[i].frequency, rows[i].repetition)]
    held = [(i, t) for i, r in enumerate(rows) if r is not None and r.holds_stops(chained)
            for t in r.stop_ids if 0 <= t and (vocab_size is None or t < vocab_size)]
    held_rows, held_ids = [i for i, _ in held], [t for _, t in held]
    drafted = [(j, t) for j, i in enumerate(penalized) for t in rows[i].draft_ids]
    draft_rows, draft_ids = [j for j, _ in drafted], [t for _, t in drafted]
    index = torch.tensor(penalized + new_rows + new_ids + prompt_ids + biased + bias_sizes + bias_ids + held_rows
                         + held_ids + draft_rows + draft_ids, dtype=torch.int64)
    sizes = [len(penalized), len(new_rows), len(new_ids), len(prompt_ids), len(biased), len(biased), len(bias_ids),
             len(held), len(held), len(drafted), len(drafted)]
    return StepUpload(index, torch.tensor(weights + bias_values, dtype=torch.float32), sizes, penalized,
                      recount, new_masks, mask_sizes, biased, new_biases, bias_sizes, len(held))


def apply_penalties(logits: torch.Tensor, rows: list[RowPenalties | None],
                    inflight_ids: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> a float32 copy with the asking rows' bias added, then their penalties applied as
    vLLM does: repetition over the prompt's and generated tokens (a positive logit divided by it, another
    multiplied), then frequency * count and presence * (count > 0) over the generated tokens subtracted;
    last, the stop ids that min_tokens holds back at -inf (nothing above can lift them again).

    inflight_ids: a chained decode step's input ids on the device ([B], `ModelRunner.launch`): each row's
    newest generated token, which the host does not have yet (regression test: without it a chained step
    took the token before it as unseen). It counts in this step's copy of the counts, never in a state
    (the host counts it at a later step, once it has it), and in the index of this step's token (min_tokens).
    Nothing here runs unless a row asks."""
    device = logits.device
    up = step_upload(rows, logits.shape[-1], chained=inflight_ids is not None)
    index = up.index.to(device, non_blocking=True)  # one copy of what the states lack
    values = up.values.to(device, non_blocking=True)
    (penalized_dev, new_rows, new_ids, prompt_ids, biased_dev, bias_sizes, bias_ids, held_rows,
     held_ids, draft_rows, draft_ids) = index.split(up.index_sizes)
    weights, bias_values = values.split([3 * len(up.penalized), len(bias_ids)])
    out = logits.to(torch.float32, copy=True)  # [B, V]
    if up.biased:
        _add_bias(out, rows, up, biased_dev, bias_sizes, bias_ids, bias_values)
    if up.penalized:
        _penalize(out, rows, up, penalized_dev, new_rows, new_ids, prompt_ids, weights.view(-1, 3), inflight_ids,
                  (draft_rows, draft_ids))
    if up.held_stops:  # (a fill kernel for the value: no copy of it to the device)
        out.index_put_((held_rows, held_ids), out.new_full((), float("-inf")))
    return out


def _add_bias(out: torch.Tensor, rows: list[RowPenalties | None], up: StepUpload, biased_dev: torch.Tensor,
              bias_sizes: torch.Tensor, bias_ids: torch.Tensor, bias_values: torch.Tensor) -> None:
    """out[row, id] += bias for every biased row's ids: one index_put over the batch."""
    states = [rows[i].state for i in up.biased]
    for j, ids, vals in zip(up.new_biases, bias_ids.split([up.bias_sizes[j] for j in up.new_biases]),
                            bias_values.split([up.bias_sizes[j] for j in up.new_biases])):
        states[j].bias_ids, states[j].bias_values = ids.clone(), vals.clone()  # (not a view of the step's upload)
    ids = torch.cat([s.bias_ids for s in states])  # [k_total]
    vals = torch.cat([s.bias_values for s in states])
    row_of = torch.repeat_interleave(biased_dev, bias_sizes, output_size=len(ids))  # [k_total], no device sync
    out.index_put_((row_of, ids), vals, accumulate=True)


def _penalize(out: torch.Tensor, rows: list[RowPenalties | None], up: StepUpload, penalized_dev: torch.Tensor,
              new_rows: torch.Tensor, new_ids: torch.Tensor, prompt_ids: torch.Tensor, weights: torch.Tensor,
              inflight_ids: torch.Tensor | None, drafts: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The penalized rows of `out`: their states take the step's new host tokens, then a copy of their
    counts takes the in-flight ones and a verify row's drafts (a device copy of [n, V]; the old way built it
    from every token). A verify step's rows of one request share its state, each taking the same new tokens."""
    n, vocab, device = len(up.penalized), out.shape[-1], out.device
    states = [rows[i].state for i in up.penalized]
    for j in up.recount:
        states[j].counts = torch.zeros(vocab, dtype=torch.float32, device=device)
    for j, ids in zip(up.new_masks, prompt_ids.split(up.mask_sizes)):
        states[j].prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)
    counts = torch.stack([s.counts for s in states])  # [n, V]: this step's copy
    if len(new_rows):
        counts.index_put_((new_rows, new_ids), torch.ones_like(new_rows, dtype=torch.float32), accumulate=True)
        torch._foreach_copy_([s.counts for s in states], list(counts.unbind(0)))  # the states count them too
    for state, i in zip(states, up.penalized):
        state.counted = len(rows[i].output_ids)
    if inflight_ids is not None:  # this step's copy only
        counts.index_put_((torch.arange(n, device=device), inflight_ids.index_select(0, penalized_dev)),
                          torch.ones(n, dtype=torch.float32, device=device), accumulate=True)
    if len(drafts[0]):  # this step's copy only
        counts.index_put_(drafts, torch.ones_like(drafts[0], dtype=torch.float32), accumulate=True)
    generated = counts > 0  # [n, V]
    seen = generated
    if any(rows[i].repetition != 1.0 for i in up.penalized):
        # a row without repetition divides and multiplies by 1 (no change) whatever it has seen: its own
        # generated mask stands in for a prompt mask it never built
        seen = generated | torch.stack([generated[j] if s.prompt_seen is None else s.prompt_seen
                                        for j, s in enumerate(states)])
    x = out.index_select(0, penalized_dev)  # [n, V]
    repetition = weights[:, 2:3]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - weights[:, 1:2] * counts - weights[:, 0:1] * generated
    out.index_copy_(0, penalized_dev, x)

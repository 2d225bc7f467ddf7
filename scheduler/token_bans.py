"""vLLM's allowed_token_ids and bad words on the device (SamplingParams.allowed_token_ids / bad_words_token_ids;
the API's fields: scheduler/ban_fields.py), as vLLM V1 applies them: every token outside a row's allowed ids
at -inf; a one-token bad word's token at -inf at every step; a longer word's last token at -inf where the
request's last output tokens are the rest of the word (vLLM V1 matches output tokens only, never the prompt's).

vLLM bans before logit_bias, min_tokens and the penalties; here after them (scheduler/runner.py `_sampled`),
on their copy where they ran: the same logits, since -inf stays -inf under a finite bias and the penalties
(a non-positive logit is multiplied by the repetition penalty, the others subtract finite values). Logprobs
stay the raw logits'.

Two kinds of bans, neither of which holds back a chained decode step (a step enqueued before the token of the
step before it is back on the host, scheduler/engine.py):

* static ones, the same at every step: the allowed ids and the one-token words, as one [V] bool mask per request
  kept on the device (PenaltyState.banned: uploaded at its first step, freed with the request);
* a longer word's last token, which depends on the newest output tokens. The host has every output token but,
  in a chained step, the newest: that one is on the device (the step's input id). So the host matches a word's
  tokens before its last two against its output, and leaves the comparison of the word's second-to-last token
  with the in-flight id to the device: (row, that token, the banned token) per candidate, a few ints a step. An
  unchained step (and a deferred one, sampled once the host has the token before it: guided rows') bans what
  the host matches whole.

A batch where no request restricts its tokens builds nothing here (BatchInput.bans is None)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from scheduler.penalty_state import PenaltyState


class RowBans(NamedTuple):
    """A batch row's bans (for a row whose request has allowed_token_ids or bad words)."""
    allowed: tuple[int, ...] | None        # SamplingParams.allowed_token_ids (read once, for its mask)
    words: tuple[tuple[int, ...], ...]     # SamplingParams.bad_words_token_ids
    output_ids: list[int]                  # its generated tokens the host has (a chained step's newest is on the
                                           # device)
    state: PenaltyState                    # the request's, kept across its steps (its mask: `banned`)

    @property
    def masked(self) -> bool:
        """Whether it has static bans (a mask)."""
        return self.allowed is not None or any(len(w) == 1 for w in self.words)

    def word_bans(self, chained: bool) -> tuple[list[int], list[int]]:
        """Its longer words' bans this step: (tokens the in-flight id must equal, or -1 where the host matched
        the whole prefix; the banned tokens). chained: the newest output token is in flight (not in
        output_ids)."""
        out, ids, bans = self.output_ids, [], []
        have = len(out) + chained  # output tokens before this step's
        for word in self.words:
            n = len(word) - 1  # the prefix's length
            if n == 0 or have < n:
                continue
            if chained:  # the prefix's last token is the in-flight one: the device compares it
                if n == 1 or tuple(out[len(out) - n + 1:]) == word[:-2]:
                    ids.append(word[-2])
                    bans.append(word[-1])
            elif tuple(out[len(out) - n:]) == word[:-1]:
                ids.append(-1)
                bans.append(word[-1])
        return ids, bans


def held_by_min_tokens(allowed: tuple[int, ...] | None, words: tuple[tuple[int, ...], ...],
                       held: tuple[int, ...]) -> bool:
    """Whether the stop ids min_tokens holds back (`held`) are all a row's allowed ids leave to sample: then they
    must not be held (the row would be -inf throughout, its token meaningless; the restriction wins, as a
    grammar does: scheduler/guided.py)."""
    if allowed is None or len(allowed) > len(held) + len(words):  # (allowed: distinct ids, SamplingParams.validate)
        return False
    return set(allowed) <= set(held) | {w[0] for w in words if len(w) == 1}


def apply_bans(logits: torch.Tensor, rows: list[RowBans | None], inflight_ids: torch.Tensor | None,
               copy: bool) -> torch.Tensor:
    """logits [B, V] with every banned token of the asking rows at -inf: in place, or in a copy (copy: the raw
    logits, which logprobs and NaN marks read). inflight_ids: a chained decode step's input ids on the device
    ([B], `ModelRunner.launch`), each row's newest output token (None: the host has every output token)."""
    device, vocab = logits.device, logits.shape[-1]
    chained = inflight_ids is not None
    masked = [i for i, r in enumerate(rows) if r is not None and r.masked]
    new_masks = [i for i in masked if rows[i].state.banned is None]
    allowed = [list(rows[i].allowed or ()) for i in new_masks]
    singles = [[w[0] for w in rows[i].words if len(w) == 1] for i in new_masks]
    word_rows, word_ids, word_bans = [], [], []
    for i, row in enumerate(rows):
        if row is not None and any(len(w) > 1 for w in row.words):
            ids, bans = row.word_bans(chained)
            word_rows += [i] * len(bans)
            word_ids += ids
            word_bans += bans
    sizes = [len(masked), *map(len, allowed), *map(len, singles), len(word_rows), len(word_ids), len(word_bans)]
    flat = masked + [t for ids in allowed + singles for t in ids] + word_rows + word_ids + word_bans
    parts = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True).split(sizes)  # one copy
    masked_dev, new_allowed, new_singles = parts[0], parts[1:1 + len(new_masks)], parts[1 + len(new_masks):-3]
    word_rows_dev, word_ids_dev, word_bans_dev = parts[-3:]
    out = logits.to(torch.float32, copy=True) if copy else logits  # (as apply_penalties' copy)
    neg_inf = out.new_full((), float("-inf"))
    for i, ids, ones in zip(new_masks, new_allowed, new_singles):  # (a request's first step that asks)
        if rows[i].allowed is None:
            banned = torch.zeros(vocab, dtype=torch.bool, device=device)
        else:
            banned = torch.ones(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, False)
        rows[i].state.banned = banned.index_fill_(0, ones, True)
    if masked:
        x = out.index_select(0, masked_dev).masked_fill_(torch.stack([rows[i].state.banned for i in masked]), neg_inf)
        out.index_copy_(0, masked_dev, x)
    if not word_rows:
        return out
    if not chained:  # (a ban twice over writes -inf twice)
        out.index_put_((word_rows_dev, word_bans_dev), neg_inf)
        return out
    # the in-flight token completes a word's prefix: -inf added to its ban, else 0 (a sum: a token banned by
    # one candidate and spared by another stays banned)
    hit = inflight_ids.index_select(0, word_rows_dev) == word_ids_dev
    out.index_put_((word_rows_dev, word_bans_dev), torch.where(hit, neg_inf, out.new_zeros(())), accumulate=True)
    return out

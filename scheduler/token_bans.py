"""vLLM's allowed_token_ids and bad words on the device (SamplingParams.allowed_token_ids / bad_words_token_ids;
the API's fields: scheduler/ban_fields.py), as vLLM V1 applies them: every token outside a row's allowed ids
at -inf; a one-token bad word's token at -inf at every step; a longer word's last token at -inf where the
request's last output tokens are the rest of the word (vLLM V1 matches output tokens only, never the prompt's).

vLLM bans before logit_bias, min_tokens and the penalties; here after them (scheduler/runner.py `_sampled`),
on their copy where they ran: the same logits, since -inf stays -inf under a finite bias and the penalties
(a non-positive logit is multiplied by the repetition penalty, the others subtract finite values). Logprobs
stay the raw logits'.

Two kinds of bans, neither of which holds back a chained decode step (a step enqueued before the token of the
step before it is back on the host, scheduler/engine_loop.py):

* static ones, the same at every step: the allowed ids and the one-token words, as one [V] bool mask per request
  kept on the device (PenaltyState.banned: uploaded at its first step, freed with the request);
* a longer word's last token, which depends on the newest output tokens. The host has every output token but,
  in a chained step, the newest: that one is on the device (the step's input id). So the host matches a word's
  tokens before its last two against its output, and leaves the comparison of the word's second-to-last token
  with the in-flight id to the device: (row, that token, the banned token) per candidate, a few ints a step; a
  two-token word is always a candidate, so the request's two-token words sit on the device from its first step
  (`WordIndex.pairs_dev`) and the host does nothing for them. An unchained step (and a deferred one, sampled once
  the host has the token before it: guided rows') bans what the host matches whole, two-token words by a lookup
  of the last output token.

A batch where no request restricts its tokens builds nothing here (BatchInput.bans is None)."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from scheduler.penalty_state import PenaltyState

if TYPE_CHECKING:
    from scheduler.request import Request


class WordIndex:
    """A request's bad words of two or more tokens, prepared at its first step that bans (kept in its
    PenaltyState.words): the two-token words, most of them in practice, are looked up rather than matched (with 128
    words in every row of a batch of 32, matching each word each step in Python held a chained decode step's
    host work past its forward: 0.877 of unbanned decode, session 43)."""
    __slots__ = ("after", "pairs_dev", "longer", "allowed", "singles", "ends")

    def __init__(self, words: tuple[tuple[int, ...], ...], allowed: tuple[int, ...] | None, device) -> None:
        pairs = [w for w in words if len(w) == 2]
        self.after: dict[int, list[int]] = {}  # a two-token word's first token -> the last tokens it bans
        for first, last in pairs:
            self.after.setdefault(first, []).append(last)
        # [2, P] int64 (first, last): a chained step's in-flight id is compared with each first token on the device
        self.pairs_dev = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).t().contiguous().to(device) \
            if pairs else None
        self.longer = tuple(w for w in words if len(w) > 2)  # matched on the host each step
        # (`sampled_banned`'s, after a step: sets, an allowed list may hold 2^18 ids)
        self.allowed = None if allowed is None else frozenset(allowed)
        self.singles = frozenset(w[0] for w in words if len(w) == 1)
        self.ends: dict[int, list[tuple[int, ...]]] = {}  # a longer word's last token -> the prefixes before it
        for w in words:
            if len(w) > 1:
                self.ends.setdefault(w[-1], []).append(w[:-1])


class RowBans(NamedTuple):
    """A batch row's bans (for a row whose request has allowed_token_ids or bad words)."""
    allowed: tuple[int, ...] | None        # SamplingParams.allowed_token_ids (read once, for its mask)
    words: tuple[tuple[int, ...], ...]     # SamplingParams.bad_words_token_ids
    output_ids: list[int]                  # its generated tokens the host has (a chained step's newest is on the
                                           # device)
    state: PenaltyState                    # the request's, kept across its steps (its mask: `banned`; `words`)

    @property
    def masked(self) -> bool:
        """Whether it has static bans (a mask)."""
        return self.allowed is not None or any(len(w) == 1 for w in self.words)

    def index(self, device) -> WordIndex:
        """Its bans' host-side index, prepared once."""
        if self.state.words is None:
            self.state.words = WordIndex(self.words, self.allowed, device)
        return self.state.words

    def sampled_banned(self, token: int) -> bool:
        """Whether `token`, sampled after output_ids (the host's, every one by now), is one of its bans: only
        where its row was -inf throughout (its bad words left none of its allowed ids, or its grammar or
        min_tokens' held stops none of the rest), which argmax answers with token 0, a draw with any."""
        index, out = self.state.words, self.output_ids
        if index is None:  # (its step built no index: it banned nothing)
            return False
        if token in index.singles or index.allowed is not None and token not in index.allowed:
            return True
        return any(len(out) >= len(prefix) and tuple(out[len(out) - len(prefix):]) == prefix
                   for prefix in index.ends.get(token, ()))

    def host_bans(self, index: WordIndex, chained: bool) -> tuple[list[int], list[int]]:
        """Its bans this step that the host decides: (tokens the in-flight id must equal, or -1 where the host
        matched the whole prefix; the banned tokens). chained: the newest output token is in flight (not in
        output_ids), so a two-token word is left to the device (`WordIndex.pairs_dev`) and a longer one's
        last-but-one token too."""
        out, ids, bans = self.output_ids, [], []
        if not chained and out:
            bans += index.after.get(out[-1], ())
            ids += [-1] * len(bans)
        have = len(out) + chained  # output tokens before this step's
        for word in index.longer:
            n = len(word) - 1  # the prefix's length
            if have < n:
                continue
            if chained:  # the prefix's last token is the in-flight one: the device compares it
                if tuple(out[len(out) - n + 1:]) == word[:-2]:
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
    device, (batch, vocab) = logits.device, logits.shape
    chained = inflight_ids is not None
    masked = [i for i, r in enumerate(rows) if r is not None and r.masked]
    new_masks = [i for i in masked if rows[i].state.banned is None]
    allowed = [list(rows[i].allowed or ()) for i in new_masks]
    singles = [[w[0] for w in rows[i].words if len(w) == 1] for i in new_masks]
    word_rows, word_ids, word_bans, pair_rows, pairs = [], [], [], [], []
    for i, row in enumerate(rows):
        if row is not None and ((index := row.index(device)).after or index.longer):
            ids, bans = row.host_bans(index, chained)
            word_rows += [i] * len(bans)
            word_ids += ids
            word_bans += bans
            if chained and index.pairs_dev is not None:
                pair_rows.append(i)
                pairs.append(index.pairs_dev)
    pair_counts = [p.shape[1] for p in pairs]
    sizes = [len(masked), *map(len, allowed), *map(len, singles), len(word_rows), len(word_ids), len(word_bans),
             len(pair_rows), len(pair_counts)]
    flat = masked + [t for ids in allowed + singles for t in ids] + word_rows + word_ids + word_bans + pair_rows + \
        pair_counts
    parts = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True).split(sizes)  # one copy
    masked_dev, new_allowed, new_singles = parts[0], parts[1:1 + len(new_masks)], parts[1 + len(new_masks):-5]
    word_rows_dev, word_ids_dev, word_bans_dev, pair_rows_dev, pair_counts_dev = parts[-5:]
    for i, ids, ones in zip(new_masks, new_allowed, new_singles):  # (a request's first step that asks)
        if rows[i].allowed is None:
            banned = torch.zeros(vocab, dtype=torch.bool, device=device)
        else:
            banned = torch.ones(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, False)
        rows[i].state.banned = banned.index_fill_(0, ones, True)
    out = logits
    if masked:  # [B, V] bool: the masked rows' masks, the others' none
        mask = torch.stack([rows[i].state.banned for i in masked])
        if len(masked) < batch:
            mask = torch.zeros((batch, vocab), dtype=torch.bool, device=device).index_copy_(0, masked_dev, mask)
        if copy and logits.dtype == torch.float32:  # (the masked copy in one pass)
            out, copy = logits.masked_fill(mask, float("-inf")), False
        else:
            out = (logits.to(torch.float32, copy=True) if copy else logits).masked_fill_(mask, float("-inf"))
            copy = False
    if not word_rows and not pairs:
        return out
    if copy:  # (as apply_penalties' copy)
        out = logits.to(torch.float32, copy=True)
    neg_inf = out.new_full((), float("-inf"))
    if not chained:  # (a ban twice over writes -inf twice)
        out.index_put_((word_rows_dev, word_bans_dev), neg_inf)
        return out
    if pairs:  # every two-token word of the rows that have them: its first token against the row's in-flight id
        pairs_dev = torch.cat(pairs, dim=1) if len(pairs) > 1 else pairs[0]  # [2, P]
        rows_dev = torch.repeat_interleave(pair_rows_dev, pair_counts_dev, output_size=pairs_dev.shape[1])
        word_rows_dev = torch.cat([word_rows_dev, rows_dev])
        word_ids_dev = torch.cat([word_ids_dev, pairs_dev[0]])
        word_bans_dev = torch.cat([word_bans_dev, pairs_dev[1]])
    # the in-flight token completes a word's prefix: -inf added to its ban, else 0 (a sum: a token banned by
    # one candidate and spared by another stays banned)
    hit = inflight_ids.index_select(0, word_rows_dev) == word_ids_dev
    out.index_put_((word_rows_dev, word_bans_dev), torch.where(hit, neg_inf, out.new_zeros(())), accumulate=True)
    return out


def nothing_left(req: "Request") -> str:
    """The error of a request whose bans (allowed_token_ids, bad words) left its row no token to sample: what it
    banned, with what else holds tokens back (its grammar's mask, min_tokens)."""
    also = " that its grammar allows" if req.guide is not None else \
        " that min_tokens does not hold back" if len(req.output) < req.params.min_tokens else ""
    return (f"no token was left to sample after {len(req.output)} generated: allowed_token_ids and bad_words ban "
            f"every token{also}")

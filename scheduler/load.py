"""The GPU work queued besides a request: what a restore of its prefix runs its reads and copies
beside (they take no SMs), while a recompute takes GPU time from all of it. The cost policy charges
a restore only its time beyond this (`CostModel.decide`'s and `worth_writing`'s hidden_s;
docs/design.md, cost model, "Load"). Priced on the cost model's recompute line:

  busy_s(engine, req)    the load besides `req`, for its restore or prefetch decision
  write_busy_s(engine)   the load besides a writer, for the write admission of the backups that
                         start after this admission pass (CacheManager.busy_s)
  pricing(engine, req, match)
                         what `decide` prices `req`'s hit `match` against: `busy_s`, its prompt's
                         length and the chunk (max_prefill_tokens), to count each option's forwards

Each walks the running and waiting requests at most once: O(queue).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from scheduler.request import Request, RequestState

if TYPE_CHECKING:
    from hicache.radix import MatchResult
    from scheduler.engine import Engine


def busy_s(engine: "Engine", req: Request | None = None) -> float:
    """Seconds of GPU work queued besides `req`: the prompt tokens the running requests still
    prefill and the waiting ones would (priced as recomputed: what they will restore is not known
    yet, but for the part a prefetch in flight reads), in forwards of at most max_prefill_tokens,
    and one decode forward if another request is decoding: the step in flight, which `req` would
    wait for anyway. Later steps hide nothing: prefills go first, so recomputed now `req` would run
    before them (regression: one long generation's 100k remaining steps made every slow read look
    free, its request waiting the read where its prefill would have run at once). Parked requests
    wait on reads and count nothing: as more park, the next hit sees less to hide its read behind.
    0 with prefetch off: a restore then blocks the loop until it lands (`Restoring._try_restore`),
    and nothing runs beside it (regression: the requests queued behind a blocking read made it
    look free, and every one of them waited for a read dearer than the recompute it saved)."""
    if not engine.cache.config.prefetch:
        return 0.0
    prefill_tokens = decoding = 0
    for r, tokens, decodes in _loads(engine):
        if r is not req:
            prefill_tokens += tokens
            decoding |= decodes
    return _busy_s(engine, prefill_tokens, bool(decoding))


def write_busy_s(engine: "Engine") -> float:
    """The load the writes started now are admitted by: as `busy_s`, the GPU work besides the
    request whose pages are written, the least for any running request (a backup is asked for as
    a request's prefill ends or as it finishes, of its own pages). Regression: the load with the
    writer in it, so a request running alone had its prompt written to L3 on the strength of its
    own remaining decode steps, where a later request alone would recompute rather than read it."""
    config = engine.cache.config
    if not (engine.cache.has_l2 and config.policy == "cost" and config.prefetch):
        return 0.0  # (nothing written, a forced policy, or blocking restores: as `busy_s`)
    loads = list(_loads(engine))
    prefill_tokens = sum(tokens for _, tokens, _ in loads)
    decoding = sum(decodes for _, _, decodes in loads)
    running = [(tokens, decodes) for r, tokens, decodes in loads if r.state is not RequestState.WAITING]
    if not running:
        return _busy_s(engine, prefill_tokens, decoding > 0)
    return min(_busy_s(engine, prefill_tokens - tokens, decoding - decodes > 0) for tokens, decodes in running)


def pricing(engine: "Engine", req: Request, match: "MatchResult") -> dict:
    """`CacheManager.decide`'s hidden_s, prompt_tokens and chunk_tokens for `req`'s hit `match`.
    hidden_s: `busy_s`, only where a lower tier has more to offer than L1 (`busy_s` walks the queue,
    and most decisions, misses and L1 hits, have nothing to price it against). prompt_tokens,
    chunk_tokens: a prompt longer than max_prefill_tokens is prefilled one forward per chunk, and a
    recompute of its prefix may run more forwards than the tail a restore leaves, each at the
    recompute line's fixed cost (`CostModel.decide`)."""
    l1, l2, l3 = match.lengths
    return {"hidden_s": busy_s(engine, req) if max(l2, l3) > l1 else 0.0,
            "prompt_tokens": req.prefill_len, "chunk_tokens": engine.config.max_prefill_tokens}


def _loads(engine: "Engine") -> Iterator[tuple[Request, int, bool]]:
    """(request, prompt tokens it still prefills, whether it will decode) for each running and
    waiting request, but those aborted and not yet ended (the loop's next tick ends them:
    regression, an aborted generation's remaining steps hid the next request's read)."""
    aborting = engine.aborting
    for r in engine.running:
        if r.rid in aborting:
            continue
        yield (r, r.prefill_len - r.cached_len if r.state is RequestState.PREFILL else 0,
               r.params.max_tokens > max(len(r.output), 1))
    for r in engine.waiting:  # (one whose prefetch reads its prefix prefills only the tail after it)
        if r.rid in aborting:
            continue
        op = r.prefetch_op
        yield r, r.prefill_len - (op.payload["l3_end"] if op is not None and not op.done else 0), False


def _busy_s(engine: "Engine", prefill_tokens: int, decoding: bool) -> float:
    forwards = -(-prefill_tokens // engine.config.max_prefill_tokens) + int(decoding)
    return engine.cache.cost.busy_s(prefill_tokens, forwards)

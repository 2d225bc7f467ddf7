"""Prometheus metrics of the HTTP server, in a private CollectorRegistry (no process-global state).

Three kinds:
* observed by the server as requests are served: request counts by outcome, engine requests by finish
  reason, TTFT, end-to-end, time per output token (TPOT) and inter-token latency histograms, prompt /
  generated token counters and per-request length histograms, requests in flight (TTFT counts every
  request that got a first token, aborted or failed ones too; end-to-end and TPOT those the engine ended:
  at max_tokens, a stop, or an error (vLLM's finished requests), not those aborted: TPOT those of >= 2
  tokens; scheduler/generation.py); as each engine request ends, its max_tokens, and if it got a first
  token its prefill, decode and inference time; as a prompt's last choice ends, its n and the most tokens
  one of its choices generated (`ServerMetrics.ended`, `PromptChoices`). Prompt tokens count once per engine
  request (each of n choices, each beam returned: vLLM's child requests), as the per-request histogram does. A
  beam search's choices (scheduler/api_beam_search.py) count in TTFT (the search's end) and end-to-end only: their
  tokens come at once, from steps the search ran as engine requests of its own, so they have no TPOT, gaps, queue
  or phase times;
* observed by the engine's runner as it launches each step: the tokens of that step (scheduler/runner.py
  `observe_step_tokens`: a prefill's prompt tokens it computes, one per decode row);
* read from the engine at scrape time by `EngineCollector` (engine.metrics() / engine.status()):
  the cache's counters (`_CACHE_COUNTERS`: hit tokens per tier, recomputed tokens, evictions,
  restores / backups / fallbacks / failures, policy skips, L3 pages lost after a read, restore time
  and its overlap with decode), per transfer direction (d2h, h2d, h2s, s2h) bytes, count, recurring
  and end-to-end seconds, the latency split by phase, GiB/s and L3 extents, the cost model's
  current estimates (GiB/s per direction, fixed costs, recompute seconds per token), pending
  operations, pool occupancy per tier (used / capacity pages and the page states), engine queue
  lengths, overlapped decode steps and restores. These say what /hicache/status says.

vLLM's names for the same state (scheduler/prom_vllm.py `VllmCollector`, labelled `model_name`) are
rendered from these families and the engine's status, so vLLM's dashboards and autoscalers work here.

Scrapes run on the event loop (the /metrics handler is async), so they read a consistent snapshot.
"""
from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hicache.metrics import DIRECTIONS, FAILURE_KINDS, NOT_OP_FAILURES
from scheduler.prom_vllm import VllmCollector

OUTCOMES = ("success", "aborted", "failed", "rejected")
FINISH_REASONS = ("stop", "length", "abort", "error")  # an engine request's end (vLLM's finished_reason)
# up to vLLM's largest (its e2e / queue / phase buckets'; its TTFT's end at 2560 s): a request of minutes lands in a
# finite bucket (regression: they ended at 120 s, and histogram_quantile read 120 s for every longer request)
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 240.0,
                      480.0, 960.0, 1920.0, 7680.0)
# a decode step's time: from a small model's millisecond up to a starved batch's seconds, then vLLM's top (80 s)
_TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                            0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_COUNT_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))  # 1, 2, 5 ... 5e6 (vLLM's 1-2-5)
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, of the n request parameter
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM V1's, tokens per step
_TIERS = ("l1", "l2", "l3")


# engine.metrics() key -> (counter, the label a dict value is keyed by or None, HELP). The keys of
# every dict are fixed up front (hicache/metrics.py), so each series exists at 0 from the start.
_CACHE_COUNTERS = (
    ("hit_tokens", "hicache_hit_tokens", "tier", "prompt tokens served from each tier"),
    ("recomputed_tokens", "hicache_recomputed_tokens", None,
     "prompt tokens computed by prefill, each counted once as kept"),
    ("evictions_pages", "hicache_evicted_pages", "tier", "pages evicted from each tier"),
    ("restores_started", "hicache_restores_started", None, "restores started"),
    ("restores_done", "hicache_restores_done", None, "restores completed"),
    ("prefetches_started", "hicache_prefetches_started", None, "L3 -> L2 prefetches started"),
    ("prefetches_taken", "hicache_prefetches_taken", None,
     "prefetches their request took on to L1 once landed (each then a restore started)"),
    ("prefetches_done", "hicache_prefetches_done", None, "prefetches ended in L2 with no request taking them on"),
    ("backups_started", "hicache_backups_started", None, "backups started"),
    ("backups_done", "hicache_backups_done", None, "backups completed"),
    ("fallbacks", "hicache_fallbacks", None,
     "requests that computed what a restore of theirs, failed or not started, was to bring"),
    ("promotions", "hicache_promotions", None, "L3 -> L2 promotions"),
    ("cancellations", "hicache_cancellations", None, "cancelled operations"),
    ("failures", "hicache_operation_failures", "kind", "failures by kind: operations that failed ("
     + ", ".join(k for k in FAILURE_KINDS if k not in NOT_OP_FAILURES) + "), and a request's or a store's ("
     + ", ".join(NOT_OP_FAILURES) + ")"),
    ("policy_skips", "hicache_policy_skips", "kind", "requests that recomputed a lower-tier hit rather "
     "than restore it (restore) and backups not written to L2 / L3 (write_l2, write_l3): refused by the "
     "cost policy, or no free page in the tier"),
    ("storage_missing_pages", "hicache_storage_missing_pages", None,
     "L3 pages dropped after a failed read: vanished, corrupt or unreadable, and those under them"),
    ("storage_adopted_pages", "hicache_storage_adopted_pages", None,
     "L3 pages adopted at start from the index an earlier engine left on the file (--hicache-storage-persist)"),
    ("nan_dropped_pages", "hicache_nan_dropped_pages", "tier",
     "pages dropped from each tier because a request that reused them got NaN logits, and those under them"),
    ("restore_s", "hicache_restore_seconds", None, "wall time of completed restores, start to publication in L1"),
    ("restore_overlapped_s", "hicache_restore_overlapped_seconds", None,
     "wall time decode batches ran while a restore was pending"),
)
# per direction (d2h, h2d, h2s, s2h): DirectionStats key -> (counter, HELP)
_DIRECTION_COUNTERS = (
    ("bytes", "hicache_transfer_bytes", "bytes moved per direction"),
    ("count", "hicache_transfers", "transfers per direction"),
    ("recurring_s", "hicache_transfer_seconds", "recurring transfer time per direction, what the cost model "
     "learns (no one-time workspace setup, no wait for the caller's stream)"),
    ("end_to_end_s", "hicache_transfer_end_to_end_seconds", "transfer time per direction, start to completion seen"),
)
_PHASES = ("enqueue", "setup", "compute_wait", "queue_wait", "seen_wait", "service")
_COST_LINES = ("d2h", "h2d", "h2s", "s2h", "recompute")
_REDIS_EVENTS = ("writes", "reads", "pages_written", "pages_read", "bytes_written", "bytes_read", "round_trips",
                 "missing_pages", "corrupt_pages", "hint_queries", "hint_skips", "hints_not_needed",
                 "hint_pages_found", "hint_pages_published", "hint_rechecks", "stale_hints_dropped",
                 "suspect_pages_deleted")


def _family(cls, name: str, doc: str, value, label: str | None = None):
    """One metric family: a number, or a dict of numbers keyed by `label`'s values."""
    fam = cls(name, doc, labels=[label] if label else None)
    for key, v in (value.items() if label else [(None, value)]):
        fam.add_metric([key] if label else [], float(v))
    return fam


class EngineCollector(Collector):
    """Engine and cache-hierarchy state, read when scraped."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        status = self.engine.status()
        m = self.engine.metrics()
        m["failures"] = {**dict.fromkeys(FAILURE_KINDS, 0), **m["failures"]}
        for key, name, label, doc in _CACHE_COUNTERS:
            yield _family(CounterMetricFamily, name, doc, m[key], label)

        dirs = m["directions"]
        for key, name, doc in _DIRECTION_COUNTERS:
            yield _family(CounterMetricFamily, name, doc, {d: s[key] for d, s in dirs.items()}, "direction")
        yield _family(GaugeMetricFamily, "hicache_transfer_gib_per_second", "achieved bandwidth per direction "
                      "(bytes over recurring seconds, since start)", {d: s["gib_s"] for d, s in dirs.items()},
                      "direction")
        phases = CounterMetricFamily(
            "hicache_transfer_phase_seconds", "transfer time per direction by phase: enqueue, setup (one-time "
            "workspace allocation), compute_wait (behind the caller's stream), queue_wait (behind other "
            "transfers or L3 I/O), seen_wait (device done to a thread seeing it), service (the copy or L3 "
            "I/O); phases can overlap (a CPU copy runs inside its enqueue)", labels=["direction", "phase"])
        for d, s in dirs.items():
            for phase in _PHASES:
                phases.add_metric([d, phase], float(s[f"{phase}_s"]))
        yield phases
        yield _family(CounterMetricFamily, "hicache_storage_extents", "L3 I/O calls per direction, after "
                      "coalescing adjacent slots", {d: dirs[d]["extents"] for d in ("h2s", "s2h")}, "direction")
        store = status.get("storage") or {}
        if store.get("backend") == "redis":  # the shared store's own events (hicache/storage_redis.py)
            yield _family(CounterMetricFamily, "hicache_redis_events", "the shared Redis L3's counters by event: "
                          "round trips, pages read / written / missing / corrupt, hint queries and the pages they "
                          "found, stale hints dropped (pages the server lost behind this engine's tree) and "
                          "pages of a NaN prefix deleted", {k: store[k] for k in _REDIS_EVENTS}, "event")

        # what the cost policy decides with now: is a restore from L2 / L3 cheaper than recomputing?
        lines = status["cost_model"]["directions"]
        yield _family(GaugeMetricFamily, "hicache_cost_model_gib_per_second", "the cost model's current bandwidth "
                      "estimate per direction (+Inf: no per-byte cost learned); an L3 restore pays s2h then h2d",
                      {d: math.inf if lines[d]["gib_s"] is None else lines[d]["gib_s"] for d in DIRECTIONS},
                      "direction")
        yield _family(GaugeMetricFamily, "hicache_cost_model_recompute_seconds_per_token", "the cost model's "
                      "current prefill cost per prompt token: what a restore saves per token it brings",
                      lines["recompute"]["us_per_token"] * 1e-6)
        yield _family(GaugeMetricFamily, "hicache_cost_model_fixed_seconds", "the cost model's current fixed "
                      "cost of one transfer per direction, or of one prefill (recompute)",
                      {line: lines[line]["fixed_s"] for line in _COST_LINES}, "line")
        yield _family(GaugeMetricFamily, "hicache_cost_model_samples", "samples in each cost line's window "
                      "(0: the estimate is the configured prior)",
                      {line: lines[line]["samples"] for line in _COST_LINES}, "line")

        pending = GaugeMetricFamily("hicache_pending_operations", "operations in flight by kind", labels=["kind"])
        for kind, v in (status.get("pending") or {}).items():
            pending.add_metric([kind], float(v))
        yield pending

        used = GaugeMetricFamily("hicache_pool_used_pages", "pages in use per tier", labels=["tier"])
        cap = GaugeMetricFamily("hicache_pool_capacity_pages", "pages per tier", labels=["tier"])
        pages = GaugeMetricFamily("hicache_pool_pages", "pages per tier and state", labels=["tier", "state"])
        for tier in _TIERS:
            t = (status.get("tiers") or {}).get(tier)
            if not t:
                continue
            cap.add_metric([tier], float(t["capacity_pages"]))
            used.add_metric([tier], float(t["capacity_pages"] - t["free_pages"]))
            for state in ("free", "resident", "evictable", "protected", "private"):
                pages.add_metric([tier, state], float(t[f"{state}_pages"]))
        yield from (used, cap, pages)

        eng = status.get("engine", {})
        queue = GaugeMetricFamily("hicache_engine_requests", "engine requests by state", labels=["state"])
        for state in ("waiting", "parked", "running"):
            queue.add_metric([state], float(eng.get(state, 0)))
        yield queue
        yield _family(CounterMetricFamily, "hicache_engine_batches", "batches run", eng.get("batches", 0))
        yield _family(CounterMetricFamily, "hicache_engine_tokens", "tokens by kind: prefill, the prompt tokens "
                      "computed (and a preempted request's K/V its resumption computed again); decode, the tokens "
                      "decode and verify steps yielded (a verify step's rejected drafts left out)",
                      {"prefill": eng.get("prefill_tokens", 0), "decode": eng.get("decode_tokens", 0)}, "kind")
        yield _family(CounterMetricFamily, "hicache_engine_overlapped_steps", "work overlapped with the device by "
                      "kind: decode steps enqueued before the previous step's tokens were back, restores whose "
                      "tail forward ran behind the layer-ordered copy",
                      {"decode_chain": eng.get("chained_steps", 0), "restore": eng.get("restore_overlaps", 0)},
                      "kind")
        yield _family(GaugeMetricFamily, "hicache_engine_decode_reserve_ratio", "the share of its remaining "
                      "max_tokens a request admitted now reserves L1 pages for (--decode-reserve-ratio; auto: its "
                      "current value)", eng.get("decode_reserve_ratio", 1.0))
        yield _family(CounterMetricFamily, "hicache_engine_restore_waits_timed_out", "forwards whose wait for a "
                      "layer-ordered restore gave up on the device (output discarded, tail run again)",
                      eng.get("restore_waits_timed_out", 0))


class ServerMetrics:
    """The server's own metrics plus the engine collector and vLLM's names of both (labelled `model_name`:
    the served model name, by default the engine's model), in one private registry."""

    def __init__(self, engine, model_name: str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("hicache_requests", "completion requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.finished = Counter("hicache_requests_finished", "engine requests (choices) that ended, by finish "
                                "reason: stop, length, abort (the client left, or shutdown), error",
                                ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        self.ttft = Histogram("hicache_time_to_first_token_seconds", "request arrival to first token",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("hicache_e2e_request_latency_seconds", "request arrival to its end, of engine "
                             "requests the engine ended (stop, length, error; not aborted)",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue = Histogram("hicache_request_queue_time_seconds", "arrival to the first prefill's start (queued, "
                               "or parked on a restore), of requests that got a first token",
                               buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("hicache_time_per_output_token_seconds", "first token to the end over the tokens "
                              "after the first, of engine requests of >= 2 tokens the engine ended (stop, length, "
                              "error; not aborted)",
                              buckets=_TOKEN_LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("hicache_inter_token_latency_seconds", "each engine step's gap after its request's "
                             "previous token, as the server reads them (one per step after the first token; a "
                             "verify step's accepted drafts share their step's)",
                             buckets=_TOKEN_LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("hicache_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("hicache_generation_tokens", "generated tokens, each counted as the "
                                         "server reads it (an aborted request's unread ones as it ends)", registry=r)
        self.request_prompt_tokens = Histogram("hicache_request_prompt_tokens", "prompt tokens per engine request "
                                               "that ended", buckets=_TOKEN_COUNT_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("hicache_request_generation_tokens", "generated tokens per "
                                                   "engine request that ended", buckets=_TOKEN_COUNT_BUCKETS,
                                                   registry=r)
        # a request's phases as vLLM splits them, from the same three instants (so prefill + decode = inference):
        # its first prefill's start (Request.scheduled_s), its first and last token as the server read them
        self.prefill = Histogram("hicache_request_prefill_time_seconds", "first prefill's start to first token, "
                                 "of engine requests that got one (any end)", buckets=_LATENCY_BUCKETS_S, registry=r)
        self.decode = Histogram("hicache_request_decode_time_seconds", "first token to last (the sum of its "
                                "inter-token gaps), of engine requests that got one (any end)",
                                buckets=_LATENCY_BUCKETS_S, registry=r)
        self.inference = Histogram("hicache_request_inference_time_seconds", "first prefill's start to last "
                                   "token, of engine requests that got one (any end)", buckets=_LATENCY_BUCKETS_S,
                                   registry=r)
        self.request_n = Histogram("hicache_request_params_n", "the n (choices) of each prompt of a request, once "
                                   "per prompt as its last choice ends", buckets=_N_BUCKETS, registry=r)
        self.request_max_generation_tokens = Histogram(
            "hicache_request_max_generation_tokens", "the most tokens one of a prompt's choices generated, once per "
            "prompt as its last choice ends", buckets=_TOKEN_COUNT_BUCKETS, registry=r)
        # the engine's steps: one histogram per engine, made by its first server and rendered by each (as the
        # engine's own counters are; regression: a second server took the runner's hook over, so the first's
        # stopped counting and the second's missed the steps before it, neither agreeing with engine_batches)
        hooked = getattr(engine.runner.observe_step_tokens, "__self__", None)
        if isinstance(hooked, Histogram):
            self.step_tokens = hooked
            r.register(hooked)
        else:
            self.step_tokens = Histogram("hicache_engine_step_tokens", "tokens of each engine step (forward) as it "
                                         "is launched: a prefill's prompt tokens it computes, one per decode row",
                                         buckets=_STEP_TOKEN_BUCKETS, registry=r)
            engine.runner.observe_step_tokens = self.step_tokens.observe
        self._prompt: PromptChoices | None = None  # the prompt whose choices are being made (`prompt_choice`)
        self.request_max_tokens = Histogram("hicache_request_params_max_tokens", "max_tokens of each engine request "
                                            "that ended (0, a prefill alone, not counted)",
                                            buckets=_TOKEN_COUNT_BUCKETS, registry=r)
        self.in_flight = Gauge("hicache_requests_in_flight", "HTTP generation requests being served, each choice "
                               "(n, a batch's prompts, beams) counted: the --max-concurrent-requests slots held",
                               registry=r)
        r.register(EngineCollector(engine))
        r.register(VllmCollector(self, engine, engine.config.model if model_name is None else model_name))

    def outcome(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def prompt_choice(self, api_req, index: int, choice: int) -> "PromptChoices":
        """Choice `choice` of prompt `index` of `api_req` was made: the tally its prompt's choices share. The
        server makes a prompt's choices one after another, choice 0 first, nothing between (scheduler/server.py),
        so the tally of choice 0 is the one its siblings join; any other prompt starts a new one."""
        p = self._prompt
        if choice == 0 or p is None or p.api_req is not api_req or p.index != index:
            p = self._prompt = PromptChoices(api_req, index)
        p.open += 1
        return p

    def ended(self, finish_reason: str, prompt_tokens: int, generation_tokens: int, max_tokens: int = 0,
              n: int | None = None, span_s: tuple[float, float, float] | None = None,
              max_generation_tokens: int | None = None, counted_tokens: int = 0) -> None:
        """An engine request ended (each choice once): its reason, its tokens and their per-request histograms,
        its max_tokens (0, a prefill alone: not observed, as vLLM observes none); n and max_generation_tokens: its
        prompt's n and the most tokens one of its choices generated, given by the choice that ends it last
        (`PromptChoices.ended`); span_s: (first prefill's start, first token, last token), perf_counter
        seconds, where it got a first token; counted_tokens: those of its generation_tokens the generation counter
        has already (each as the server read it, scheduler/generation.py): the rest are counted now."""
        self.finished.labels(finish_reason if finish_reason in FINISH_REASONS else "error").inc()
        self.generation_tokens.inc(max(0, generation_tokens - counted_tokens))
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if max_tokens:
            self.request_max_tokens.observe(max_tokens)
        if n is not None:
            self.request_n.observe(n)
        if max_generation_tokens is not None:
            self.request_max_generation_tokens.observe(max_generation_tokens)
        if span_s is not None:
            scheduled_s, first_token_s, last_token_s = span_s
            self.prefill.observe(first_token_s - scheduled_s)
            self.decode.observe(last_token_s - first_token_s)
            self.inference.observe(last_token_s - scheduled_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PromptChoices:
    """The choices (engine requests) of one prompt as they end (vLLM's ParentRequest): the prompt's n and the
    most tokens one of them generated are observed once, as its last choice ends."""

    __slots__ = ("api_req", "index", "open", "most_tokens")

    def __init__(self, api_req, index: int) -> None:
        self.api_req, self.index = api_req, index
        self.open = 0  # choices made that have not ended
        self.most_tokens = 0

    def ended(self, generation_tokens: int) -> int | None:
        """One of its choices ended with `generation_tokens`: the most of them all where it was the last to end."""
        self.open -= 1
        self.most_tokens = max(self.most_tokens, generation_tokens)
        if self.open:
            return None
        # its choices are all made (one after another, nothing between) and ended: let the request's body go
        # (regression: ServerMetrics._prompt held the last prompt's body, its whole prompt, until the next request)
        self.api_req = None
        return self.most_tokens

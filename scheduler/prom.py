"""Prometheus metrics of the HTTP server, in a private CollectorRegistry (no process-global state).

Two kinds:
* observed by the server as requests are served: request counts by outcome, TTFT and end-to-end
  latency histograms, prompt / generated token counters, requests in flight (TTFT counts every
  request that got a first token, aborted or failed ones too; end-to-end only those that finished,
  at max_tokens or a stop token);
* read from the engine at scrape time by `EngineCollector` (engine.metrics() / engine.status()):
  hit tokens per tier, recomputed tokens, evictions, restores / backups / fallbacks, bytes, count,
  seconds and GiB/s per transfer direction (d2h, h2d, h2s, s2h), pending operations, pool
  occupancy per tier (used / capacity pages and the page states), engine queue lengths, overlapped
  decode steps and restores.

Scrapes run on the event loop (the /metrics handler is async), so they read a consistent snapshot.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

OUTCOMES = ("success", "aborted", "failed", "rejected")
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TIERS = ("l1", "l2", "l3")


class EngineCollector(Collector):
    """Engine and cache-hierarchy state, read when scraped."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        status = self.engine.status()
        m = self.engine.metrics()

        def counter(name, doc, value, labels=None, **label_values):
            fam = CounterMetricFamily(name, doc, labels=labels)
            if labels:
                for key, v in value.items():
                    fam.add_metric([key], float(v))
            else:
                fam.add_metric([], float(value))
            return fam

        yield counter("hicache_hit_tokens", "prompt tokens served from each tier", m["hit_tokens"], ["tier"])
        yield counter("hicache_recomputed_tokens", "prompt tokens computed by prefill, each counted once as kept", m["recomputed_tokens"])
        yield counter("hicache_evicted_pages", "pages evicted from each tier", m["evictions_pages"], ["tier"])
        for key, doc in (("restores_started", "restores started"), ("restores_done", "restores completed"),
                         ("backups_started", "backups started"), ("backups_done", "backups completed"),
                         ("fallbacks", "restores that fell back to recompute"),
                         ("promotions", "L3 -> L2 promotions"), ("cancellations", "cancelled operations")):
            yield counter(f"hicache_{key}", doc, m[key])
        yield counter("hicache_restore_overlapped_seconds", "restore time overlapped with decode",
                      m["restore_overlapped_s"])
        yield counter("hicache_operation_failures", "failed operations by kind", m.get("failures", {}), ["kind"])

        dirs = m["directions"]
        nbytes = CounterMetricFamily("hicache_transfer_bytes", "bytes moved per direction", labels=["direction"])
        count = CounterMetricFamily("hicache_transfers", "transfers per direction", labels=["direction"])
        secs = CounterMetricFamily("hicache_transfer_seconds", "recurring transfer time per direction",
                                   labels=["direction"])
        rate = GaugeMetricFamily("hicache_transfer_gib_per_second", "achieved bandwidth per direction",
                                 labels=["direction"])
        for d, s in dirs.items():
            nbytes.add_metric([d], float(s["bytes"]))
            count.add_metric([d], float(s["count"]))
            secs.add_metric([d], float(s["recurring_s"]))
            rate.add_metric([d], float(s["gib_s"]))
        yield from (nbytes, count, secs, rate)

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
        yield counter("hicache_engine_batches", "batches run", eng.get("batches", 0))
        yield counter("hicache_engine_tokens", "tokens computed by kind",
                      {"prefill": eng.get("prefill_tokens", 0), "decode": eng.get("decode_tokens", 0)}, ["kind"])
        yield counter("hicache_engine_overlapped_steps", "work overlapped with the device by kind: decode steps "
                      "enqueued before the previous step's tokens were back, restores whose tail forward ran "
                      "behind the layer-ordered copy",
                      {"decode_chain": eng.get("chained_steps", 0), "restore": eng.get("restore_overlaps", 0)},
                      ["kind"])
        yield counter("hicache_engine_restore_waits_timed_out", "forwards whose wait for a layer-ordered "
                      "restore gave up on the device (output discarded, tail run again)",
                      eng.get("restore_waits_timed_out", 0))


class ServerMetrics:
    """The server's own metrics plus the engine collector, in one private registry."""

    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("hicache_requests", "completion requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.ttft = Histogram("hicache_time_to_first_token_seconds", "request arrival to first token",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("hicache_e2e_request_latency_seconds",
                             "request arrival to last token, of requests that finished (success)",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("hicache_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("hicache_generation_tokens", "generated tokens", registry=r)
        self.in_flight = Gauge("hicache_requests_in_flight", "HTTP generation requests being served", registry=r)
        r.register(EngineCollector(engine))

    def outcome(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

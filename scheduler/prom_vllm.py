"""vLLM's metric names on hicache's /metrics (scheduler/prom.py registers `VllmCollector`), so the Grafana
dashboards, alerts and autoscalers built on vLLM's (KEDA / HPA on `vllm:num_requests_waiting`) work against
hicache. Every family carries vLLM's `model_name` label: the served model name.

Nothing is observed twice: each vllm: family is rendered at scrape time from state hicache already keeps,
either a family of `ServerMetrics` (the same samples, renamed; vLLM exports no `_created` samples) or the
engine's status and cache counters, so the two names cannot disagree. What they mean, against vLLM's:
* num_requests_running: the engine's admitted requests (prefill or decode); num_requests_waiting: queued
  ones and parked ones (waiting for a restore from L2 / L3, as vLLM counts those waiting for remote KV);
* kv_cache_usage_perc (and its older alias gpu_cache_usage_perc): L1 pages neither free nor evictable, of
  L1's capacity. vLLM's free blocks include the cached ones no request holds, so its usage is what requests
  hold; hicache_pool_used_pages also counts the evictable cached pages, which fill L1 once it has run a while;
* prefix_cache_queries / prefix_cache_hits: prompt tokens looked up (hit + recomputed: a prompt's tokens once
  its prefill ran) / served from any tier (L1, L2 or L3: hicache_hit_tokens);
* request_time_per_output_token_seconds: per finished request of >= 2 tokens, (e2e - TTFT) / (tokens - 1);
  inter_token_latency_seconds: per engine step after a request's first token, its gap after the previous
  step's token, as vLLM observes it once per engine iteration and request (a step is one token but for a
  verify step's accepted drafts, which come in the step of the token before them).
  time_per_output_token_seconds is vLLM's older (deprecated) name of that gap histogram,
  rendered from the same samples;
* request_success_total by finished_reason (stop, length, abort, error), prompt / generation token counters
  and per-request histograms, TTFT and end-to-end latency: the hicache_ families of the same meaning.
  e2e_request_latency_seconds (and request_time_per_output_token_seconds) count, as vLLM's finished requests
  do, every request the engine ended at a stop, its length or an error, and none a client left: vLLM's
  client-abort path records no finished request (so its request_success{finished_reason="abort"} stays 0
  where hicache's counts them); here none aborted at shutdown either (vLLM records its engine's own aborts);
* request_queue_time_seconds: arrival to the first prefill's start (`Request.scheduled_s`), queued or parked;
* request_prefill_time_seconds / request_decode_time_seconds / request_inference_time_seconds: the first
  prefill's start to the first token / the first token to the last / the first prefill's start to the last,
  once per engine request that got a first token, whatever its end (vLLM's, aborted ones too), from the same
  three instants (prefill + decode = inference; the tokens as the server read them, as TTFT and the gaps);
* request_params_n and request_max_num_generation_tokens: each prompt's n and the most tokens one of its
  choices generated (vLLM's meaning, despite its HELP's "requested": ParentRequest's most generated tokens,
  not max_tokens), once per prompt as its last choice ends, whatever its end (vLLM: those its engine ended);
  request_params_max_tokens: each engine request's max_tokens;
* iteration_tokens_total: per engine step (forward), its tokens as the runner launches it: a prefill's computed prompt
  tokens (a chunk's, past any cached prefix), one per decode row (so its _sum is hicache_engine_tokens' without
  speculative decoding, and its _count hicache_engine_batches'). vLLM's front end counts, per step, each request's
  whole prompt in the step that made its first token (cached tokens and earlier chunks included) plus every token
  made: its first token too, and nothing for a step that made none (an early chunk). A verify step (speculative
  decoding) counts its rows: the pending tokens and their drafts (the drafts rejected too, which
  hicache_engine_tokens' decode tokens, the tokens steps yielded, leave out);
* spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens (and _per_pos, labelled position), with
  --speculative-config only: per verify step, each request that had drafts / their tokens / those accepted
  (scheduler/speculative.py), as vLLM's.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# vLLM's family <- the ServerMetrics attribute it is rendered from, and vLLM's HELP
_RENAMED = (
    ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    ("vllm:request_success", "finished", "Count of successfully processed requests."),
    ("vllm:time_to_first_token_seconds", "ttft", "Histogram of time to first token in seconds."),
    ("vllm:e2e_request_latency_seconds", "e2e", "Histogram of e2e request latency in seconds."),
    ("vllm:request_queue_time_seconds", "queue", "Histogram of time spent in WAITING phase for request."),
    ("vllm:request_time_per_output_token_seconds", "tpot",
     "Histogram of time_per_output_token_seconds per request."),
    ("vllm:inter_token_latency_seconds", "itl", "Histogram of inter-token latency in seconds."),
    ("vllm:time_per_output_token_seconds", "itl",
     "Histogram of time per output token in seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead."),
    ("vllm:request_prompt_tokens", "request_prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:request_generation_tokens", "request_generation_tokens", "Number of generation tokens processed."),
    ("vllm:request_prefill_time_seconds", "prefill", "Histogram of time spent in PREFILL phase for request."),
    ("vllm:request_decode_time_seconds", "decode", "Histogram of time spent in DECODE phase for request."),
    ("vllm:request_inference_time_seconds", "inference", "Histogram of time spent in RUNNING phase for request."),
    ("vllm:request_params_n", "request_n", "Histogram of the n request parameter."),
    ("vllm:request_params_max_tokens", "request_max_tokens", "Histogram of the max_tokens request parameter."),
    ("vllm:request_max_num_generation_tokens", "request_max_generation_tokens",
     "Histogram of maximum number of requested generation tokens."),
    ("vllm:iteration_tokens_total", "step_tokens", "Histogram of number of tokens per engine_step."),
)
_LABELS = {"finish_reason": "finished_reason"}  # hicache's label -> vLLM's


def _renamed(fam: Metric, name: str, doc: str, model_name: str) -> Metric:
    """`fam`'s samples under vLLM's name, labelled model_name (its `_created` samples left out)."""
    out = Metric(name, doc, fam.type)
    for s in fam.samples:
        if not s.name.endswith("_created"):
            labels = {_LABELS.get(k, k): v for k, v in s.labels.items()}
            out.add_sample(name + s.name[len(fam.name):], {"model_name": model_name, **labels}, s.value)
    return out


def _kv_cache_usage(status: dict) -> float:
    """vLLM's KV-cache usage: L1 pages held (neither free nor evictable) of its capacity, 0..1."""
    l1 = (status.get("tiers") or {}).get("l1")
    if not l1 or not l1["capacity_pages"]:
        return 0.0
    held = l1["capacity_pages"] - l1["free_pages"] - l1["evictable_pages"]
    return min(1.0, max(0.0, held / l1["capacity_pages"]))


class VllmCollector(Collector):
    """vLLM's families from `metrics`' (scheduler/prom.py ServerMetrics) and `engine`'s state, read when scraped."""

    def __init__(self, metrics, engine, model_name: str) -> None:
        self.metrics, self.engine, self.model_name = metrics, engine, model_name

    def _one(self, cls, name: str, doc: str, value: float):
        fam = cls(name, doc, labels=["model_name"])
        fam.add_metric([self.model_name], float(value))
        return fam

    def _spec_decode(self, spec: dict):
        """vLLM's spec_decode counters from the engine's speculative stats."""
        yield self._one(CounterMetricFamily, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                        spec["drafts"])
        yield self._one(CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                        spec["draft_tokens"])
        yield self._one(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                        spec["accepted_tokens"])
        fam = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
                                  "position.", labels=["model_name", "position"])
        for pos, count in enumerate(spec["accepted_per_pos"]):
            fam.add_metric([self.model_name, str(pos)], count)
        yield fam

    def collect(self):
        for name, attr, doc in _RENAMED:
            for fam in getattr(self.metrics, attr).collect():
                yield _renamed(fam, name, doc, self.model_name)
        status, m = self.engine.status(), self.engine.metrics()
        eng = status.get("engine", {})
        yield self._one(GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution "
                        "batches (admitted: prefill or decode).", eng.get("running", 0))
        yield self._one(GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be "
                        "processed (queued, or parked on a restore).", eng.get("waiting", 0) + eng.get("parked", 0))
        usage = _kv_cache_usage(status)
        yield self._one(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent "
                        "usage (L1 pages neither free nor evictable).", usage)
        yield self._one(GaugeMetricFamily, "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent "
                        "usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.", usage)
        yield self._one(CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the "
                        "engine (--decode-reserve-ratio below 1 or auto).", eng.get("preempted", 0))
        spec = eng.get("speculative")
        if spec is not None:  # (--speculative-config: scheduler/speculative.py)
            yield from self._spec_decode(spec)
        hits = sum(m["hit_tokens"].values())
        yield self._one(CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of "
                        "number of queried tokens.", hits + m["recomputed_tokens"])
        yield self._one(CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number "
                        "of cached tokens (from any tier).", hits)

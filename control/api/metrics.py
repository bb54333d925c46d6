"""Prometheus metrics of one app, on a registry of its own (two apps in a process never collide).

Counted by the API as requests pass: requests by route and status, prompt/completion tokens (and
how the prompt was served: reused from cache, restored, computed), time to first token and
inter-token latency (streamed or not: both are timed as the tokens reach the API). Read from the
control process at scrape time (``Backend.stats``): bytes per tier, moves by kind and outcome,
expert moves and bytes (an offloaded MoE model), stranded bytes, ledger append lag, queue depths.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from residency.control.scheduler.port import Backend, Usage

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)


class _BackendCollector:
    def __init__(self, backend: Backend):
        self.backend = backend

    def collect(self):
        s = self.backend.stats()
        yield _family(GaugeMetricFamily, "residency_tier_used_bytes", "Bytes resident per worker and tier (acked copies)",
                      ["worker", "tier"], s.tier_used_bytes)
        yield _family(GaugeMetricFamily, "residency_tier_capacity_bytes", "Capacity per worker and tier",
                      ["worker", "tier"], s.tier_capacity_bytes)
        yield _family(CounterMetricFamily, "residency_moves", "Moves by kind and terminal outcome", ["kind", "outcome"],
                      s.moves)
        yield GaugeMetricFamily("residency_stranded_bytes", "Bytes that left a place and were not reported arriving",
                                value=s.stranded_bytes)
        lag = GaugeMetricFamily("residency_ledger_append_lag_seconds",
                                "Age of the oldest event waiting to be committed to the ledger (NaN = not measured)")
        lag.add_metric([], float("nan") if s.ledger_append_lag_s is None else s.ledger_append_lag_s)
        yield lag
        yield GaugeMetricFamily("residency_ledger_last_seq", "Last committed ledger seq", value=s.ledger_last_seq)
        yield GaugeMetricFamily("residency_requests_running", "Requests generating now", value=s.running_requests)
        yield GaugeMetricFamily("residency_requests_waiting", "Requests admitted, waiting for room", value=s.waiting_requests)
        yield _family(GaugeMetricFamily, "residency_sessions", "Sessions by the tier holding their blocks", ["tier"],
                      s.sessions_by_tier)
        yield _family(CounterMetricFamily, "residency_prefix_decisions",
                      "Parked prefixes restored or recomputed; prefixes shared from another session", ["decision"],
                      s.restore_decisions)
        yield _family(CounterMetricFamily, "residency_requests_routed",
                      "Requests by why they run on their worker: their session's, the one sharing the "
                      "most of their prompt's pages, or the least loaded", ["reason"], s.routed)
        yield GaugeMetricFamily("residency_draining", "1 while the server stops: new requests get 503",
                                value=1 if s.draining else 0)
        yield CounterMetricFamily("residency_disk_kept_bytes", "Disk copies kept across worker incarnations",
                                  value=s.disk_bytes_kept)
        yield CounterMetricFamily("residency_disk_dropped_bytes",
                                  "Disk files a new worker incarnation deleted as not the ledger's",
                                  value=s.disk_bytes_dropped)
        yield _family(CounterMetricFamily, "residency_serving_steps", "Serving steps (batched forwards) by decode path: "
                      "a captured CUDA graph replayed, or eager", ["path"], s.steps_by_path)
        yield _family(CounterMetricFamily, "residency_restores", "Turns that ran over a restored prefix: pipelined (the "
                      "prefill read each layer as it landed) or plain (after the restore's ack)", ["path"],
                      s.restores_by_path)
        yield SummaryMetricFamily("residency_restore_wait_seconds",
                                  "Time prefills waited for restored pages still landing, as the workers measured it "
                                  "(per step that waited)", count_value=s.num_restore_waits, sum_value=s.restore_wait_s)
        yield _family(CounterMetricFamily, "residency_expert_moves", "An offloaded MoE model's expert moves by kind: "
                      "fetch (the layer waited), prefetch (ahead of it), evict (slot reused)", ["kind"], s.expert_moves)
        yield CounterMetricFamily("residency_expert_fetched_bytes", "Expert bytes copied host -> device "
                                  "(fetches and prefetches)", value=s.expert_fetched_bytes)
        yield _family(CounterMetricFamily, "residency_expert_served_bytes", "Bytes of the experts steps routed to, by "
                      "where they were: already on the device, or fetched for the step", ["source"],
                      s.expert_served_bytes)


def _family(kind, name: str, doc: str, labels: list[str], values: dict):
    """A metric family with one sample per key of ``values`` (a key is one label value, or a tuple of them)."""
    fam = kind(name, doc, labels=labels)
    for key, v in sorted(values.items()):
        fam.add_metric(list(key) if isinstance(key, tuple) else [key], v)
    return fam


class ApiMetrics:
    def __init__(self, backend: Backend):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("residency_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("residency_prompt_tokens", "Prompt tokens by how they were served",
                                     ["source"], registry=r)
        self.completion_tokens = Counter("residency_completion_tokens", "Completion tokens generated", registry=r)
        self.finished = Counter("residency_generations_finished", "Generations by finish reason", ["reason"], registry=r)
        self.ttft = Histogram("residency_time_to_first_token_seconds", "Request received to first token sent",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("residency_inter_token_latency_seconds", "Time between successive output tokens",
                             ["endpoint"], buckets=ITL_BUCKETS, registry=r)
        r.register(_BackendCollector(backend))

    def observe_usage(self, usage: Usage | None) -> None:
        if usage is None:
            return
        # sources add up to the prompt: a shared prefix (resident or restored first) counts as shared only
        own_restored = 0 if usage.shared_tokens else usage.restored_tokens
        self.prompt_tokens.labels("cached_resident").inc(
            max(0, usage.cached_tokens - usage.shared_tokens - own_restored))
        self.prompt_tokens.labels("shared").inc(usage.shared_tokens)
        self.prompt_tokens.labels("restored").inc(own_restored)
        self.prompt_tokens.labels("computed").inc(usage.computed_tokens)
        self.completion_tokens.inc(usage.completion_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class TokenClock:
    """Times one request's tokens as they reach the API: time to its first token, then the gaps
    between the tokens of each choice. A chunk of ``k`` tokens after a gap ``g`` counts as ``k``
    gaps of ``g / k``. Whether the client gets them streamed or in one answer does not matter."""

    def __init__(self, metrics: ApiMetrics, endpoint: str, t0: float):
        self.metrics = metrics
        self.endpoint = endpoint
        self.t0 = t0
        self.first_seen = False
        self.prev: dict[int, float] = {}       # choice -> when its last tokens came

    def tokens(self, choice: int, num_tokens: int, now: float) -> None:
        if not num_tokens:
            return
        if not self.first_seen:
            self.first_seen = True
            self.metrics.ttft.labels(self.endpoint).observe(now - self.t0)
        prev = self.prev.get(choice)
        if prev is not None:
            itl = self.metrics.itl.labels(self.endpoint)
            for _ in range(num_tokens):
                itl.observe((now - prev) / num_tokens)
        self.prev[choice] = now

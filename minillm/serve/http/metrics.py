"""Prometheus metrics of `minillm serve` (GET /metrics), in a registry of their own.

Gauges read the engine snapshot the engine thread publishes after every step; counters and histograms are
updated on the event loop's thread from the outputs it dispatches, so the engine thread does no metrics work.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_ADMISSION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.125, 0.25, 0.5,
                      1.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, snapshot, replicas=None):
        """snapshot(): the latest EngineStats (summed over data-parallel replicas; KV usage their mean) plus
        requests handed to the engine thread but not yet admitted. replicas: (count, stats()) of data-parallel
        replicas, whose own gauges are labelled replica="i"."""
        self.registry = r = CollectorRegistry()
        Gauge("minillm_requests_running", "Requests (completions) scheduled and holding KV blocks.",
              registry=r).set_function(lambda: snapshot()[0].num_running)
        Gauge("minillm_requests_waiting", "Requests (completions) queued and not yet running, plus requests "
              "on their way to the engine.", registry=r).set_function(lambda: snapshot()[0].num_waiting
                                                                      + snapshot()[1])
        Gauge("minillm_kv_cache_usage", "Fraction of KV-cache blocks held by live requests (0..1).",
              registry=r).set_function(lambda: snapshot()[0].kv_cache_usage)
        Gauge("minillm_preemptions", "Preemptions since start.",
              registry=r).set_function(lambda: snapshot()[0].num_preemptions)
        if replicas is not None:
            self._replica_gauges(*replicas)
        self.prompt_tokens = Counter("minillm_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("minillm_generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter("minillm_requests_finished", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("minillm_requests_rejected", "Requests answered with an error before reaching "
                                "the engine, by HTTP status.", ["status"], registry=r)
        self.ttft = Histogram("minillm_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("minillm_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.admission = Histogram("minillm_admission_seconds", "Time from arrival to the engine taking the "
                                   "request (its add_request returned on the engine thread; with engine processes, "
                                   "the request is then on its way to the core): the server's own hops before "
                                   "any engine work, part of the TTFT.", buckets=_ADMISSION_BUCKETS, registry=r)
        self.e2e = Histogram("minillm_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=_E2E_BUCKETS, registry=r)

    def _replica_gauges(self, count: int, stats) -> None:
        gauges = {"running": ("num_running", "Requests running on each data-parallel replica."),
                  "waiting": ("num_waiting", "Requests waiting on each data-parallel replica."),
                  "kv_cache_usage": ("kv_cache_usage", "KV-cache usage of each data-parallel replica (0..1).")}
        for name, (field, doc) in gauges.items():
            g = Gauge(f"minillm_replica_{name}", doc, ["replica"], registry=self.registry)
            for i in range(count):
                g.labels(str(i)).set_function(lambda i=i, field=field: getattr(stats()[i], field))

    def on_finished(self, output, arrival: float) -> None:
        """One finished request (all its completions): its reason and latencies (arrival = when the HTTP layer
        received it, so queueing before the engine counts)."""
        for c in output.outputs:
            self.finished.labels(c.finish_reason or "unknown").inc()
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - arrival))
        for gap in m.itls:
            self.itl.observe(gap)
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - arrival))

    def render(self) -> bytes:
        return generate_latest(self.registry)

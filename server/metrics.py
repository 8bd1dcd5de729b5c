"""Prometheus metrics of one app, in the app's own `CollectorRegistry`.

Counters and histograms are updated as requests run; the backend gauges (queue depth,
KV usage, prefix hit rate, running requests) are refreshed from `backend.stats()` at
each scrape, so they cost nothing between scrapes. A gauge whose key the backend does
not report (e.g. the router's estimate, single-rank) stays at 0.
"""

from __future__ import annotations

from typing import Mapping

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

__all__ = ["ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# backend.stats() key -> (gauge name, help)
_GAUGES = {
    "num_waiting": ("phalanx_queue_depth", "Requests waiting to be scheduled"),
    "num_running": ("phalanx_running_requests", "Requests the engine is running"),
    "kv_usage": ("phalanx_kv_cache_usage_ratio", "Fraction of KV cache pages in use"),
    "prefix_hit_rate": ("phalanx_prefix_cache_hit_rate",
                        "Fraction of prompt tokens served from the prefix cache"),
    "healthy": ("phalanx_backend_healthy", "1 while the backend can serve, 0 once it failed"),
    "recoveries": ("phalanx_recoveries", "Groups re-formed after a rank failure (prefill "
                   "instances, decode or colocated groups) since start"),
    "width": ("phalanx_dp_width", "DP ranks the decode (or colocated) group serves with now"),
    "desired_width": ("phalanx_dp_width_desired",
                      "DP ranks the decode (or colocated) group should have (more than "
                      "phalanx_dp_width while a lost rank's capacity is missing)"),
    "prefill_width": ("phalanx_prefill_instances_serving", "Prefill instances serving"),
    "ep_width": ("phalanx_ep_width", "Ranks per DP×EP group of the layout serving now"),
    "ep_groups": ("phalanx_ep_groups", "DP×EP groups of the layout serving now"),
    "reshardings": ("phalanx_ep_reshardings", "Layout changes the EP-width policy made (every "
                    "group re-formed at its new width) since start"),
    "ep_predicted_step_ms": ("phalanx_ep_predicted_step_ms",
                             "The EP-width policy's last predicted decode step of its layout"),
    "ep_measured_step_ms": ("phalanx_ep_measured_step_ms",
                            "Decode step the layout runs at (wall time per step while busy)"),
    "microbatch_share": ("phalanx_microbatch_share",
                         "Share of DP×EP steps run as two overlapped micro-batches"),
    "router_prefix_hit_estimate": ("phalanx_router_prefix_hit_estimate",
                                   "Fraction of routed prompt tokens the chosen target held, "
                                   "by the router's prefix tree"),
}


class ServerMetrics:
    """The metric families of one server; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("phalanx_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("phalanx_time_to_first_token_seconds",
                              "Time from request arrival to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("phalanx_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("phalanx_request_latency_seconds",
                             "Generation request latency, arrival to last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("phalanx_prompt_tokens", "Prompt tokens received",
                                     registry=r)
        self.generation_tokens = Counter("phalanx_generation_tokens", "Tokens generated",
                                         registry=r)
        self.in_flight = Gauge("phalanx_http_requests_in_flight",
                               "Generation requests the server is handling", registry=r)
        self._gauges = {key: Gauge(name, doc, registry=r) for key, (name, doc) in _GAUGES.items()}
        self.step_ms = Gauge("phalanx_microbatch_step_ms",
                             "Mean DP×EP step (ms) by tokens per rank (up to `tokens`, a "
                             "power of two) and micro-batches (1 or 2)",
                             ["tokens", "microbatches"], registry=r)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def observe_tokens(self, n: int, since_last_s: float, first: bool) -> None:
        """`n` tokens arrived `since_last_s` after the previous delta (or the request's
        arrival, for the first delta)."""
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        if first:
            self.ttft.observe(since_last_s)
        else:
            per_token = since_last_s / n
            for _ in range(min(n, 64)):
                self.itl.observe(per_token)

    def render(self, stats: Mapping[str, float]) -> bytes:
        """Refresh the backend gauges from `stats` and return the exposition text."""
        for key, gauge in self._gauges.items():
            if key in stats:
                gauge.set(float(stats[key]))
        for key, value in stats.items():
            if key.startswith("microbatch_step_ms:"):
                _, tokens, n = key.split(":")
                self.step_ms.labels(tokens=tokens, microbatches=n).set(float(value))
        return generate_latest(self.registry)

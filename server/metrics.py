"""Prometheus metrics of one app, in the app's own `CollectorRegistry`.

Two families of names:
- what vLLM exports, under the same names with `phalanx:` for `vllm:` and the same
  `model_name` label, so a vLLM dashboard works after that prefix change:
  `num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc` (gauges);
  `prompt_tokens`, `generation_tokens`, `request_success{finished_reason}`,
  `num_preemptions`, `prefix_cache_queries`, `prefix_cache_hits` (counters, `_total`);
  `time_to_first_token_seconds`, `inter_token_latency_seconds`,
  `e2e_request_latency_seconds`, `request_queue_time_seconds` and
  `request_prefill_time_seconds` (as the engine that produced the first token measured
  them), `request_decode_time_seconds` (first to last token), `request_prompt_tokens`,
  `request_generation_tokens` (histograms);
- phalanx's own, `phalanx_*`: HTTP requests by route and status, the recovery and layout
  gauges, `phalanx:recoveries_total` beside the `phalanx_recoveries` gauge, micro-batching.

Counters and histograms are updated as requests run; the backend's numbers are read from
`backend.stats()` at each scrape, so they cost nothing between scrapes. A backend total
that goes down (a re-formed group's ranks count from 0 again) is taken as a restart of
that count: the counter adds the new value, never goes back. A gauge whose key the
backend does not report (e.g. the router's estimate, single-rank) stays at 0.
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
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
P = "phalanx:"  # vLLM's names with this prefix for "vllm:"

# backend.stats() key -> (gauge name, help); labelled by model_name when named P...
_GAUGES = {
    "num_waiting": (P + "num_requests_waiting", "Requests waiting to be scheduled"),
    "num_running": (P + "num_requests_running", "Requests the engine is running"),
    "num_held": ("phalanx_router_held_requests",
                 "Requests waiting at the router for a DP group with room (part of "
                 "num_requests_waiting)"),
    "kv_usage": (P + "kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1)"),
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
    "kernel_compiles_after_ready": ("phalanx_kernel_compiles_after_ready",
                                    "Triton kernel variants compiled after the engine was "
                                    "ready (each cost a request its compile time; 0 is the "
                                    "goal)"),
    "router_prefix_hit_estimate": ("phalanx_router_prefix_hit_estimate",
                                   "Fraction of routed prompt tokens the chosen target held, "
                                   "by the router's prefix tree"),
}


# backend.stats() totals -> (counter name, help), fed at each scrape
_TOTALS = {
    "prefix_query_tokens": (P + "prefix_cache_queries",
                            "Prompt tokens looked up in the prefix cache"),
    "prefix_hit_tokens": (P + "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "num_preemptions": (P + "num_preemptions", "Sequences preempted for want of KV pages"),
    "recoveries": (P + "recoveries", "Groups re-formed after a rank failure"),
}


class _Total:
    """A counter fed from a backend total that may restart from 0."""

    __slots__ = ("counter", "last")

    def __init__(self, counter) -> None:
        self.counter, self.last = counter, 0.0

    def feed(self, total: float) -> None:
        self.counter.inc(total - self.last if total >= self.last else total)
        self.last = total


class ServerMetrics:
    """The metric families of one server; `render()` is the /metrics body."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, {"model_name": model_name}
        self.requests = Counter("phalanx_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(P + name, doc, ["model_name"], buckets=buckets,
                             registry=r).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(P + name, doc, ["model_name"], registry=r).labels(**label)

        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from request arrival to the first generated token",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Generation request latency, arrival to last token", _E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "A choice's wait in its engine's queue before its first step",
                                    _E2E_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "A choice's first step to its first token (the prefill)",
                                      _E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "A choice's first to last generated token", _E2E_BUCKETS)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens of a choice",
                                        _TOKEN_BUCKETS)
        self.request_generation = histogram("request_generation_tokens",
                                            "Tokens a choice generated", _TOKEN_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self._success = Counter(P + "request_success", "Choices finished, by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self._totals_now = {"requests": 0.0, "prompt_tokens": 0.0, "generation_tokens": 0.0}
        self.in_flight = Gauge("phalanx_http_requests_in_flight",
                               "Generation requests the server is handling", registry=r)
        self._gauges = {key: Gauge(name, doc, ["model_name"], registry=r).labels(**label)
                        if name.startswith(P) else Gauge(name, doc, registry=r)
                        for key, (name, doc) in _GAUGES.items()}
        self._totals = {key: _Total(counter(name[len(P):], doc))
                        for key, (name, doc) in _TOTALS.items()}
        self.step_ms = Gauge("phalanx_microbatch_step_ms",
                             "Mean DP×EP step (ms) by tokens per rank (up to `tokens`, a "
                             "power of two) and micro-batches (1 or 2)",
                             ["tokens", "microbatches"], registry=r)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        if route.startswith("/v1/") and route.endswith("completions"):
            self._totals_now["requests"] += 1

    def count_prompt(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)
        self._totals_now["prompt_tokens"] += tokens

    def totals(self) -> dict[str, float]:
        """Generation requests answered, prompt and generated tokens since start."""
        return dict(self._totals_now)

    def observe_tokens(self, n: int, since_last_s: float, first: bool) -> None:
        """`n` tokens arrived `since_last_s` after the previous delta (or the request's
        arrival, for the first delta)."""
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        self._totals_now["generation_tokens"] += n
        if first:
            self.ttft.observe(since_last_s)
        else:
            per_token = since_last_s / n
            for _ in range(min(n, 64)):
                self.itl.observe(per_token)

    def engine_times(self, queued_s: float, prefill_s: float) -> None:
        """A choice's queue and prefill time as its engine measured them."""
        self.queue_time.observe(queued_s)
        self.prefill_time.observe(prefill_s)

    def finished(self, reason: str, prompt_tokens: int, generated: int,
                 decode_s: float) -> None:
        """A choice ended with `reason` ("stop", "length", "abort")."""
        self._success.labels(model_name=self._model_name, finished_reason=reason).inc()
        self.request_prompt.observe(prompt_tokens)
        self.request_generation.observe(generated)
        if generated:
            self.decode_time.observe(decode_s)

    def render(self, stats: Mapping[str, float]) -> bytes:
        """Refresh the backend gauges and totals from `stats`; the exposition text."""
        for key, gauge in self._gauges.items():
            if key in stats:
                gauge.set(float(stats[key]))
        for key, total in self._totals.items():
            if key in stats:
                total.feed(float(stats[key]))
        for key, value in stats.items():
            if key.startswith("microbatch_step_ms:"):
                _, tokens, n = key.split(":")
                self.step_ms.labels(tokens=tokens, microbatches=n).set(float(value))
        return generate_latest(self.registry)

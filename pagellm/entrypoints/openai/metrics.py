"""Prometheus metrics of one server, in a private registry (two apps in one process never clash).

Gauges (running and waiting requests, KV cache usage) and the core's own counters (prefix-cache
queries and hits, preemptions) are read from the engine core's scheduler stats when `/metrics`
is scraped. Token counters and latency histograms are
recorded per request by `RequestTimer`, from the times the server receives outputs.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagellm.outputs import CompletionOutput, RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The server's metrics; each one carries the served model's name as `model_name`."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.running = self._gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        # the core's counters since start, by SchedulerStats field; advanced when scraped
        self.core_counters = {
            "prefix_cache_queries": self._counter(
                "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
            ),
            "prefix_cache_hits": self._counter(
                "prefix_cache_hits", "Prompt tokens found in the prefix cache."
            ),
            "num_preemptions": self._counter("num_preemptions", "Requests preempted."),
            "spec_decode_num_drafts": self._counter(
                "spec_decode_num_drafts", "Verify steps of a request with draft tokens."
            ),
            "spec_decode_num_draft_tokens": self._counter(
                "spec_decode_num_draft_tokens", "Draft tokens verified."
            ),
            "spec_decode_num_accepted_tokens": self._counter(
                "spec_decode_num_accepted_tokens", "Draft tokens accepted."
            ),
        }
        self.accepted_per_pos = Counter(
            "pagellm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a step's drafts (0: the first).",
            ["model_name", "position"],
            registry=self.registry,
        )
        self.accepted_per_pos_seen: list[int] = []
        self.core_seen: dict[str, float] = {}
        self.requests = Counter(
            "pagellm:request_success",
            "Completions finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Time between two outputs of one completion (one decode step).",
            _ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "Request latency, end to end.", _LATENCY_BUCKETS
        )
        self.engine_restarts = self._counter("engine_restarts", "EngineCores started anew.")

    def _gauge(self, name: str, doc: str) -> Any:
        gauge = Gauge(f"pagellm:{name}", doc, ["model_name"], registry=self.registry)
        return gauge.labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Any:
        counter = Counter(f"pagellm:{name}", doc, ["model_name"], registry=self.registry)
        return counter.labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        histogram = Histogram(
            f"pagellm:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry
        )
        return histogram.labels(self.model_name)

    def set_scheduler_stats(self, stats: dict[str, Any]) -> None:
        self.running.set(stats.get("num_running_reqs", 0))
        self.waiting.set(stats.get("num_waiting_reqs", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        for field, counter in self.core_counters.items():
            value = stats.get(field, 0)
            if value > self.core_seen.get(field, 0):  # a Counter only goes up by increments
                counter.inc(value - self.core_seen.get(field, 0))
                self.core_seen[field] = value
        seen = self.accepted_per_pos_seen
        for pos, value in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", [])):
            if pos >= len(seen):
                seen.append(0)
            if value > seen[pos]:
                self.accepted_per_pos.labels(self.model_name, str(pos)).inc(value - seen[pos])
                seen[pos] = value

    def on_engine_restart(self) -> None:
        """A new core holds nothing yet: the gauges start from zero; the counters go on, and
        the new core's own counters (from zero) add to them."""
        self.engine_restarts.inc()
        self.core_seen.clear()
        self.accepted_per_pos_seen.clear()
        self.set_scheduler_stats({})

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Times one engine request (one prompt, all its n completions) from its DELTA outputs."""

    __slots__ = ("metrics", "start", "first_token", "last_output")

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.last_output: dict[int, float] = {}  # completion index -> when its last tokens came

    def on_output(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if self.first_token is None and any(c.token_ids for c in out.outputs):
            self.first_token = now
            self.metrics.ttft.observe(now - self.start)
            self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        for completion in out.outputs:
            self._on_completion(completion, now)
        if out.finished:
            self.metrics.e2e.observe(now - self.start)

    def _on_completion(self, completion: CompletionOutput, now: float) -> None:
        metrics = self.metrics
        if completion.token_ids:
            last = self.last_output.get(completion.index)
            if last is not None:
                metrics.itl.observe(now - last)
            self.last_output[completion.index] = now
            metrics.generation_tokens.inc(len(completion.token_ids))
        if completion.finish_reason is not None:
            metrics.requests.labels(metrics.model_name, completion.finish_reason).inc()

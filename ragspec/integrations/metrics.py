"""Prometheus metrics of the REST service, in a registry of its own (one per app).

Names (all prefixed ``ragspec_``; times in seconds):
    requests_total{endpoint, status}         finished HTTP requests by status code (endpoint: the
                                             path, a route template for a parameter, else "other")
    rejected_requests_total                  429s (queue full)
    cancelled_requests_total                 generations dropped because the client left
    prompt_tokens_total, generated_tokens_total
    drafted_tokens_total, accepted_tokens_total
    invalid_draft_tokens_total               draft nodes dropped before verification (ids
                                             outside the vocabulary, malformed trees: a
                                             damaged datastore, a buggy drafter)
    decode_steps_total                       target forwards after the prefill
    drafted_tokens_per_position_total{position}, accepted_tokens_per_position_total{position}
        per draft depth (0 = first draft token): steps that drafted / accepted a token
        there; their ratio is the acceptance rate per position
    mean_accepted_tokens                     committed tokens per decode step over all
                                             requests so far (bonus included; 1.0 = plain)
    request_mean_accepted_tokens             histogram of the same, per request
    prefill_seconds_total, draft_seconds_total, verify_seconds_total
    request_latency_seconds{endpoint}        histogram, arrival to last byte of the answer
    time_to_first_token_seconds{endpoint}    histogram, arrival to first generated text
    queue_depth, active_requests             gauges (read at scrape time): requests
                                             admitted and not generating yet (being read,
                                             prepared, or waiting), generations running
    steps_total                              worker steps (one engine step each)
    step_batch_size                          histogram: requests in a step (prefilling
                                             and decoding); gauge last_step_batch_size
    step_rows                                histogram: verification rows of a step
                                             (roots + draft nodes of all requests); gauge
                                             last_step_rows
    step_prefill_tokens                      histogram: prompt tokens prefilled in a step
                                             (chunked prefill)
    step_seconds                             histogram: wall time of a step
    queue_time_seconds                       histogram: submitted to the worker until
                                             admitted to the active set (token budget)

P50 / P95 / P99 come from the histograms, e.g.
``histogram_quantile(0.95, rate(ragspec_request_latency_seconds_bucket[5m]))``.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ragspec.types import GenerationStats

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0, 128.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0, 16.0, 32.0)
_ACCEPTED_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_ROWS_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
_PREFILL_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048)
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 4.0)
_QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class ServerMetrics:
    """The service's counters, gauges and histograms.

    Args:
        queue_depth: returns the number of requests waiting (read at scrape time).
        active: returns the number of generations in progress.
    """

    def __init__(
        self, queue_depth: Optional[Callable[[], float]] = None, active: Optional[Callable[[], float]] = None
    ) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "ragspec_"
        self.requests = Counter(p + "requests", "Finished HTTP requests.", ["endpoint", "status"], registry=r)
        self.rejected = Counter(p + "rejected_requests", "Requests refused with 429 (queue full).", registry=r)
        self.cancelled = Counter(p + "cancelled_requests", "Generations dropped because the client left.", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished generations.", registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "Generated tokens.", registry=r)
        self.cached_prompt_tokens = Counter(
            p + "cached_prompt_tokens",
            "Prompt tokens of finished generations served by the prefix cache (not prefilled).",
            registry=r,
        )
        self.drafted_tokens = Counter(p + "drafted_tokens", "Draft tokens verified.", registry=r)
        self.accepted_tokens = Counter(p + "accepted_tokens", "Draft tokens accepted.", registry=r)
        self.invalid_draft_tokens = Counter(
            p + "invalid_draft_tokens",
            "Draft nodes dropped before verification (ids outside the vocabulary).",
            registry=r,
        )
        self.decode_steps = Counter(p + "decode_steps", "Target forwards after the prefill.", registry=r)
        self.drafted_per_position = Counter(
            p + "drafted_tokens_per_position",
            "Steps that drafted a token at this draft depth.",
            ["position"],
            registry=r,
        )
        self.accepted_per_position = Counter(
            p + "accepted_tokens_per_position",
            "Steps whose draft token at this depth was accepted.",
            ["position"],
            registry=r,
        )
        self.mean_accepted = Gauge(
            p + "mean_accepted_tokens",
            "Committed tokens per decode step over all requests (bonus included).",
            registry=r,
        )
        self.request_mean_accepted = Histogram(
            p + "request_mean_accepted_tokens",
            "Committed tokens per decode step, per request.",
            buckets=_ACCEPTED_BUCKETS,
            registry=r,
        )
        self.prefill_s = Counter(p + "prefill_seconds", "Time in prefill forwards.", registry=r)
        self.draft_s = Counter(p + "draft_seconds", "Time spent drafting.", registry=r)
        self.verify_s = Counter(p + "verify_seconds", "Time in verification forwards (and KV commit).", registry=r)
        self.latency = Histogram(
            p + "request_latency_seconds",
            "Request latency, arrival to last byte.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Arrival to first generated text.",
            ["endpoint"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(p + "queue_depth", "Requests admitted, not generating yet.", registry=r)
        self.active = Gauge(p + "active_requests", "Generations in progress.", registry=r)
        if queue_depth is not None:
            self.queue_depth.set_function(queue_depth)
        if active is not None:
            self.active.set_function(active)
        self.steps = Counter(p + "steps", "Worker steps (one engine step each).", registry=r)
        self.step_batch = Histogram(p + "step_batch_size", "Requests in one step.", buckets=_BATCH_BUCKETS, registry=r)
        self.last_batch = Gauge(p + "last_step_batch_size", "Requests in the latest step.", registry=r)
        self.step_rows = Histogram(
            p + "step_rows", "Verification rows of one step (roots + draft nodes).", buckets=_ROWS_BUCKETS, registry=r
        )
        self.last_rows = Gauge(p + "last_step_rows", "Verification rows of the latest step.", registry=r)
        self.step_prefill = Histogram(
            p + "step_prefill_tokens", "Prompt tokens prefilled in one step.", buckets=_PREFILL_BUCKETS, registry=r
        )
        self.step_s = Histogram(p + "step_seconds", "Wall time of one step.", buckets=_STEP_BUCKETS, registry=r)
        self.queue_time = Histogram(
            p + "queue_time_seconds",
            "Submitted to the worker until admitted to the active set.",
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        self._lock = threading.Lock()
        self._total_committed = 0
        self._total_steps = 0

    def observe_generation(self, stats: GenerationStats) -> None:
        """Add one finished generation's counters (called from the worker thread)."""
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.cached_prompt_tokens.inc(stats.num_cached_prompt_tokens)
        self.generated_tokens.inc(stats.num_generated_tokens)
        self.drafted_tokens.inc(stats.num_drafted_tokens)
        self.accepted_tokens.inc(stats.num_accepted_tokens)
        self.invalid_draft_tokens.inc(stats.num_invalid_draft_tokens)
        self.decode_steps.inc(stats.num_steps)
        for pos, n in stats.drafted_per_position.items():
            self.drafted_per_position.labels(position=str(pos)).inc(n)
        for pos, n in stats.accepted_per_position.items():
            self.accepted_per_position.labels(position=str(pos)).inc(n)
        self.prefill_s.inc(stats.prefill_s)
        self.draft_s.inc(stats.draft_s)
        self.verify_s.inc(stats.verify_s)
        if stats.num_steps:
            self.request_mean_accepted.observe(stats.mean_accepted_tokens)
        with self._lock:
            self._total_committed += max(0, stats.num_generated_tokens - 1)
            self._total_steps += stats.num_steps
            if self._total_steps:
                self.mean_accepted.set(self._total_committed / self._total_steps)

    def observe_step(self, report) -> None:
        """One worker step (a :class:`~ragspec.engine.StepReport`; None is ignored)."""
        if report is None:
            return
        self.steps.inc()
        self.step_batch.observe(report.requests)
        self.last_batch.set(report.requests)
        self.step_rows.observe(report.rows)
        self.last_rows.set(report.rows)
        self.step_prefill.observe(report.prefill_tokens)
        self.step_s.observe(report.seconds)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)

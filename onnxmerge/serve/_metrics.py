"""The server's Prometheus metrics, in a registry of each app's own (two apps in one process
count apart)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """Requests by route and status, their latency, new tokens, queue depth and batch sizes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "onnxmerge_serve_requests",
            "HTTP requests answered, by route and status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "onnxmerge_serve_request_seconds",
            "Time from a request's arrival to its answer, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.new_tokens = Counter(
            "onnxmerge_serve_new_tokens",
            "Tokens generated, by model.",
            ["model"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "onnxmerge_serve_queue_depth",
            "Requests waiting for a batch, by model.",
            ["model"],
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "onnxmerge_serve_batch_size",
            "Inputs run together in one batch, by model.",
            ["model"],
            buckets=_BATCH_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "onnxmerge_serve_requests_in_flight",
            "Requests being answered (not counting /health and /metrics).",
            registry=self.registry,
        )

    def text(self) -> bytes:
        return generate_latest(self.registry)

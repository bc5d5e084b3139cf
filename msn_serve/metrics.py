"""Prometheus metrics on a private registry (several apps in one test process must not collide).

Names mirror what operators know from TEI/Triton: request count/latency by route template and status, queue
depth, batch size, kept tokens per image, inference time, and errors by kind.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("msn_http_requests", "HTTP requests", ["route", "method", "status"], registry=r)
        self.latency = Histogram("msn_http_request_seconds", "HTTP request latency", ["route", "method"],
                                 registry=r, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.queue_depth = Gauge("msn_queue_depth", "images waiting for inference", registry=r)
        self.batch_size = Histogram("msn_batch_size", "images per inference batch", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.kept_tokens = Histogram("msn_kept_tokens", "kept patch tokens per image", registry=r,
                                     buckets=(1, 4, 16, 32, 49, 64, 98, 128, 147, 196, 256, 576, 1024))
        self.padded_tokens = Counter("msn_padded_tokens", "padding tokens added to mixed-K batches", registry=r)
        self.inference = Histogram("msn_inference_seconds", "ONNX Runtime time per batch", registry=r,
                                   buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
        self.queue_wait = Histogram("msn_queue_wait_seconds", "time from enqueue to batch start", registry=r,
                                    buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1))
        self.errors = Counter("msn_errors", "errors by kind", ["kind"], registry=r)
        self.fits = Gauge("msn_fits_in_flight", "few-shot fits running or waiting for a worker", registry=r)
        self.ready = Gauge("msn_ready", "1 when warmed up and inference works", registry=r)
        self.model_info = Gauge("msn_model_info", "the model served (always 1; the labels say which)",
                                ["model_id", "precision", "device", "runtime"], registry=r)
        self.runtime_candidates = Gauge("msn_runtime_candidate_images_per_second",
                                        "start-up images/s of each runtime/precision measured by --precision auto",
                                        ["candidate"], registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure ASGI middleware: counts every response by the *route template* (bounded label cardinality)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "GET")
            self.metrics.requests.labels(path, method, str(status["code"])).inc()
            self.metrics.latency.labels(path, method).observe(time.perf_counter() - start)
            if status["code"] >= 400:
                self.metrics.errors.labels(f"http_{status['code']}").inc()

"""Prometheus metrics on a private registry (several apps in one test process must not collide).

Names mirror what operators know from TEI/Triton: request count/latency by route template and status, queue
depth, batch size, kept tokens per image, inference time, and errors by kind.

Two levels: :class:`Metrics` holds what belongs to the process (HTTP requests, errors, fits) and one
:class:`ModelMetrics` per served model (its queue, batches, tokens, inference, readiness, runtime choice), each on a
registry of its own, because a model can be replaced while serving and its series must then start afresh without
re-registering names. When one model is served its series appear as they always have (no extra label); with several,
every per-model series carries a ``model`` label naming it (:class:`_PerModelSeries`).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ModelMetrics:
    """One model's series (the batcher and the embedding service write them); ``errors`` is the process's."""

    SERIES = ("queue_depth", "batch_size", "kept_tokens", "padded_tokens", "inference", "queue_wait", "ready",
              "model_info", "runtime_candidates")

    def __init__(self, errors: Counter) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.errors = errors
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
        self.ready = Gauge("msn_ready", "1 when warmed up and inference works", registry=r)
        self.model_info = Gauge("msn_model_info", "the model served (always 1; the labels say which)",
                                ["model_id", "precision", "device", "runtime"], registry=r)
        self.runtime_candidates = Gauge("msn_runtime_candidate_images_per_second",
                                        "start-up images/s of each runtime/precision measured by --precision auto",
                                        ["candidate"], registry=r)


class Metrics:
    """The process's series, and the per-model ones of every model served (:meth:`for_model`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("msn_http_requests", "HTTP requests", ["route", "method", "status"], registry=r)
        self.latency = Histogram("msn_http_request_seconds", "HTTP request latency", ["route", "method"],
                                 registry=r, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.errors = Counter("msn_errors", "errors by kind", ["kind"], registry=r)
        self.fits = Gauge("msn_fits_in_flight", "few-shot fits running or waiting for a worker", registry=r)
        self.http_workers = Gauge("msn_http_workers", "HTTP worker processes running (0: one process serves HTTP)",
                                  registry=r)
        self.http_worker_restarts = Counter("msn_http_worker_restarts", "HTTP worker processes restarted after "
                                            "they died", registry=r)
        self.models: dict[str, ModelMetrics] = {}
        r.register(_PerModelSeries(self))

    def new_model_series(self) -> ModelMetrics:
        """Fresh series for a model being loaded; rendered once :meth:`publish` says the model serves."""
        return ModelMetrics(self.errors)

    def publish(self, name: str, series: ModelMetrics) -> None:
        """Render ``series`` as model ``name``'s from now on (a replaced model's series go with it)."""
        self.models[name] = series

    def withdraw(self, name: str) -> None:
        self.models.pop(name, None)

    def __getattr__(self, name: str) -> Any:
        """A per-model series asked of the process's metrics (a batcher or embedding service built on its own, as
        in tests and tools): one model's series, made on first use and rendered as the only model's."""
        if name not in ModelMetrics.SERIES or "models" not in self.__dict__:
            raise AttributeError(name)
        alone = self.__dict__.get("_alone")
        if alone is None:
            alone = self.__dict__["_alone"] = self.new_model_series()
            self.models.setdefault("default", alone)
        return getattr(alone, name)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def record(self, route: str, method: str, status: int, seconds: float) -> None:
        """One HTTP request answered (by this process, or by an HTTP worker process that reported it)."""
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)
        if status >= 400:
            self.errors.labels(f"http_{status}").inc()


class _PerModelSeries:
    """A collector yielding every model's series: as they are for one model, with a ``model`` label for several."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # names vary with the models served; nothing to check for collisions at registration

    def collect(self) -> Iterator[Metric]:
        models = list(self.metrics.models.items())
        if len(models) == 1:
            yield from models[0][1].registry.collect()
            return
        merged: dict[str, Metric] = {}
        for name, series in models:
            for family in series.registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                out.samples.extend(s._replace(labels={**s.labels, "model": name}) for s in family.samples)
        yield from merged.values()


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
            self.metrics.record(path, scope.get("method", "GET"), status["code"], time.perf_counter() - start)

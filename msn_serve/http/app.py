"""FastAPI application factory: middleware (auth, body limit, metrics), JSON errors, health and metrics routes.

The app holds one :class:`~msn_serve.runtime.Runtime` (``app.state.runtime``), started and stopped by the lifespan.
Services raise :class:`~msn_serve.errors.ApiError`; the handlers here render it, and everything else, as JSON.

Every non-2xx response is JSON with an ``error`` key — including 404s for unknown routes and FastAPI's validation
errors (reshaped to ``{"error": ..., "detail": [...]}``) — because OIP clients cannot parse anything else.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import signal
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from msn_serve.config import Settings
from msn_serve.embedding.models import MSN_ALIAS
from msn_serve.errors import ApiError, storage_error
from msn_serve.http import oip, openai_api, routes
from msn_serve.http.auth import KeyRing
from msn_serve.http.embedder import LocalEmbedder
from msn_serve.http.guard import GuardMiddleware
from msn_serve.http.responses import StrictJSONResponse
from msn_serve.metrics import MetricsMiddleware
from msn_serve.runtime import Runtime

log = logging.getLogger("msn_serve")
def _document_model_names(app: FastAPI, runtime: Runtime) -> None:
    """The OIP ``{model}`` path parameter takes the default model's id, ``msn`` or a model's name: say so in the
    OpenAPI document (the names of the moment: models can be added while serving)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = generate()
        names = list(dict.fromkeys([runtime.info.model_id, MSN_ALIAS, *runtime.models.names()]))
        for operations in app.openapi_schema.get("paths", {}).values():
            for op in operations.values():
                for param in op.get("parameters", []):
                    if param.get("name") == "model" and param.get("in") == "path":
                        param["schema"] = {"type": "string", "enum": names}
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _reload_keys_on_sighup(app: FastAPI, keys: KeyRing, runtime: Runtime) -> None:
    """SIGHUP re-reads the keys file too; the runtime's own SIGHUP work (a reader's reload) still runs. The handler
    is kept as ``app.state.on_sighup`` for a front end that installs its own (HTTP worker processes forward it)."""

    def on_sighup() -> None:
        if keys.keys_file is not None:
            keys.reload(force=True)
        runtime._spawn(runtime.on_sighup())  # what Runtime.start installed for SIGHUP

    app.state.on_sighup = on_sighup
    if keys.keys_file is None:
        return
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_sighup)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (in-process test clients)
        log.info("SIGHUP key reload not installed (event loop not in the main thread)")


def create_app(settings: Settings, runtime: Runtime | None = None) -> FastAPI:
    """The app over ``runtime`` (made from ``settings`` when not given)."""
    runtime = runtime or Runtime(settings)
    keys = KeyRing(runtime.api_key, settings.api_keys_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await runtime.start()
        _reload_keys_on_sighup(app, keys, runtime)
        if runtime.quarantined:
            log.error("quarantined at start-up (see %s/quarantine): %s", settings.data_dir, runtime.quarantined)
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(title="msn-serve", version=oip.package_version(), lifespan=lifespan,
                  default_response_class=StrictJSONResponse,
                  description="Masked Siamese Network embeddings, few-shot classifiers and FAISS search "
                              "over an exported bundle. All errors are JSON: {\"error\": ..., \"detail\"?: ...}.")
    app.state.runtime = runtime
    app.state.embedder = LocalEmbedder(runtime)  # the embedding routes' path (msn_serve.http.embedder)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content=exc.body(), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in exc.errors()]
        named = "; ".join(f"{'.'.join(str(x) for x in d['loc'][1:]) or d['loc'][0]}: {d['msg']}" for d in detail[:3])
        return JSONResponse(status_code=422, content={"error": named or "invalid request", "detail": detail})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"error": str(exc.detail)},
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(OSError)
    async def _disk(request: Request, exc: OSError) -> JSONResponse:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return await _unhandled(request, exc)
        err = storage_error(exc, f"{request.method} {request.url.path}")
        return JSONResponse(status_code=err.status, content=err.body(), headers=err.headers)

    @app.exception_handler(Exception)
    async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        runtime.metrics.errors.labels("internal").inc()
        return JSONResponse(status_code=500, content={"error": f"internal server error: {type(exc).__name__}"})

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, Any]:
        """Liveness: the process and event loop answer."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz(model: str | None = None) -> JSONResponse:
        """Readiness: every model warmed up and its inference works (after failures, re-checked with a real forward
        pass); ``?model=NAME`` for one model. Each model's detail is under ``models``."""
        ok, detail = await runtime.readiness(model)
        return JSONResponse(status_code=200 if ok else 503, content={"ready": ok, **detail})

    @app.get("/metrics", tags=["health"])
    async def metrics() -> Response:
        body, ctype = runtime.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/info", tags=["health"])
    async def info(model: str | None = None) -> dict[str, Any]:
        """Model and bundle facts clients need (patch grid for masks, preprocessing): the default model's, or
        ``?model=NAME``'s; ``models`` lists every model served."""
        served = runtime.models.get(model)
        i, engine = served.info, served.embedding.engine
        return {"model_id": i.model_id, "dim": i.embed_dim, "patch_size": i.patch_size, "image_size": i.image_size,
                "grid": i.grid, "num_patches": i.num_patches, "feature": i.feature,
                "preprocessing": i.preprocessing.to_dict(), "device": engine.device, "precision": engine.precision,
                "runtime": engine.runtime, "runtime_choice": served.choice.describe(),
                "max_batch_size": settings.max_batch_size, "max_wait_ms": settings.max_wait_ms,
                "role": runtime.role, "snapshot_version": runtime.snapshots.version, "model": served.name,
                "default_model": runtime.models.default.name,
                "models": [m.card() for m in runtime.models.models.values()]}

    app.include_router(routes.router)
    app.include_router(oip.router)
    _document_model_names(app, runtime)
    # Added last = outermost: metrics also count the 401/413 answers the guard gives.
    app.add_middleware(GuardMiddleware, keys=keys, max_body=settings.max_body_bytes)
    openai_api.install(app)  # outside the guard: its 401/413 on /v1 get OpenAI's error shape
    app.add_middleware(MetricsMiddleware, metrics=runtime.metrics)
    return app

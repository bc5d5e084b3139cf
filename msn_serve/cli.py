"""``msn-serve``: flags override ``MSN_SERVE_*`` environment variables; settings are printed (key redacted)."""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from msn_serve.config import Settings
from msn_serve.device import cuda_refusal

FLAGS: list[tuple[str, type, str]] = [
    ("bundle", str, ("exported bundle directory (msn-export output), served as model 'default'; or NAME=PATH, "
                     "repeatable, to serve several models (the first is the default model)")),
    ("models-dir", str, "serve every subfolder holding msn.json as a model named after it (re-read on SIGHUP)"),
    ("data-dir", str, "directory for classifiers and indexes (created if missing)"),
    ("host", str, "bind address (default 127.0.0.1)"),
    ("port", int, "TCP port (default 8000; 0 = any free port)"),
    ("api-key-file", str, "file with the Bearer API key; omit for no auth"),
    ("device", str, ("cpu (default), cuda (ONNX Runtime's CUDA provider and flat/IVF FAISS indexes on the GPU; "
                     "refuses to start, naming what is missing, when onnxruntime-gpu, a GPU build of faiss or a "
                     "GPU is not here) or auto (cuda when all are here, else cpu; /readyz says which and why)")),
    ("precision", str, ("auto (default: the fastest gated choice on this CPU, measured at start-up), fp32, "
                        "int8 (the bundle's guarded graph) or bf16 (OpenVINO, CPUs with bf16 units)")),
    ("runtime", str, "auto (default), onnxruntime or openvino (CPU)"),
    ("max-batch-size", int, "images per inference batch"),
    ("max-wait-ms", float, ("how long the first image waits for company when the engine is idle (default 0: at "
                            "once; while the engine is busy the next batch fills anyway)")),
    ("queue-size", int, "images allowed to wait; beyond that requests get 503 + Retry-After"),
    ("max-body-mb", float, "request body limit (413 beyond)"),
    ("max-image-pixels", int, "decoded width*height limit per image (413 beyond)"),
    ("max-images-per-request", int, "images per request (413 beyond)"),
    ("max-request-pixels", int, "decoded pixels summed over one request's images (413 beyond)"),
    ("max-vectors-per-request", int, "vectors/embeddings/ids in one add, fit or predict (413 beyond)"),
    ("max-queries-per-search", int, "query vectors or images in one search (413 beyond)"),
    ("max-k", int, "largest k of a search or prediction (422 beyond)"),
    ("max-results-per-request", int, "queries x k in one search or prediction (413 beyond)"),
    ("max-metadata-bytes", int, "JSON bytes of one id's metadata (413 beyond)"),
    ("max-index-metadata-mb", float, "JSON bytes of all metadata of one index (413 beyond)"),
    ("max-response-mb", float, "response body size (413 beyond)"),
    ("max-label-chars", int, "characters of one few-shot label (422 beyond)"),
    ("max-fit-samples", int, "examples in one few-shot fit (413 beyond)"),
    ("max-fit-classes", int, "distinct labels in one few-shot fit (413 beyond)"),
    ("select-candidates", int, "items select/suggest consider: a seeded sample of the index beyond this"),
    ("max-select", int, "largest n of a select or suggest request (413 beyond)"),
    ("max-page", int, "largest limit of a predict_index page (413 beyond)"),
    ("fit-workers", int, "few-shot fit worker processes (fits running at once)"),
    ("preprocess-threads", int, "threads decoding uploads (0 = 2 on cpu, every core on cuda)"),
    ("preprocess-workers", int, "worker processes decoding uploads instead of threads (0 = threads)"),
    ("http-workers", str, ("HTTP worker processes handing decoded crops to this engine process in shared memory: N, "
                           "auto (from the engine and the cores; /readyz says what and why) or 0 (default: one "
                           "process serves HTTP)")),
    ("http-worker-slots", int, "image slots per HTTP worker process, at least --max-images-per-request (images in "
                               "flight; beyond, 503 + Retry-After)"),
    ("max-queued-fits", int, "fits waiting for a worker; beyond that 503 + Retry-After"),
    ("fit-timeout-s", float, "stop a fit after this many seconds (422)"),
    ("fit-threads", int, "threads of each fit"),
    ("timeout-headers-s", float, "close a connection whose request headers take longer than this"),
    ("timeout-keep-alive-s", float, "close an idle keep-alive connection after this"),
    ("max-connections", int, "open connections; beyond, 503 + Retry-After and close"),
    ("http", str, "HTTP parser: auto (httptools when installed), httptools or h11"),
    ("intra-op-threads", int, "ONNX Runtime intra-op threads (0 = cores)"),
    ("index-backend", str, "faiss (default) or milvus: where a new index goes unless its create names a backend"),
    ("milvus-uri", str, ("Milvus for milvus-backed indexes: a Milvus Lite file PATH.db (embedded; default "
                         "DATA_DIR/milvus.db) or a server URL http://host:19530 (pip install 'msn[milvus]')")),
    ("log-level", str, "debug, info, warning, error"),
    ("role", str, "writer (default) or reader (= --read-only)"),
    ("reload-poll-s", float, "reader: reload when published/CURRENT changes, checked this often (0 = off)"),
    ("publish-interval-s", float, "writer: publish a snapshot this often if anything changed (0 = off)"),
    ("publish-keep", int, "published snapshot versions to keep"),
    ("url-max-mb", float, "largest image fetched for a URL input of /v1/embeddings (413 beyond)"),
    ("url-timeout-s", float, "time allowed to fetch one URL input of /v1/embeddings"),
    ("api-keys-file", str, "keys with scopes, one 'read,write sha256:<hex> name' a line; re-read on change/SIGHUP"),
]


def parse_args(argv: Sequence[str] | None) -> dict:
    p = argparse.ArgumentParser(prog="msn-serve", description="Serve an MSN bundle: embeddings, few-shot "
                                "classifiers, FAISS search, Open Inference Protocol. Every flag can also be "
                                "set as MSN_SERVE_<NAME> (e.g. MSN_SERVE_MAX_BATCH_SIZE=64; "
                                "MSN_SERVE_BUNDLE=a=/models/a,b=/models/b).")
    for name, typ, help_ in FLAGS:
        extra = {"choices": ["cpu", "cuda", "auto"]} if name == "device" else {}
        extra = {"choices": ["writer", "reader"]} if name == "role" else extra
        extra = {"choices": ["auto", "fp32", "int8", "bf16"]} if name == "precision" else extra
        extra = {"choices": ["auto", "onnxruntime", "openvino"]} if name == "runtime" else extra
        extra = {"choices": ["auto", "httptools", "h11"]} if name == "http" else extra
        extra = {"choices": ["faiss", "milvus"]} if name == "index-backend" else extra
        extra = {"action": "append"} if name == "bundle" else extra
        p.add_argument(f"--{name}", type=typ, default=argparse.SUPPRESS, help=help_, **extra)
    p.add_argument("--no-fp16", dest="fp16", action="store_false", default=argparse.SUPPRESS,
                   help="on CUDA, serve the fp32 graph")
    p.add_argument("--read-only", dest="read_only", action="store_true", default=argparse.SUPPRESS,
                   help="read-only replica: refuse writes, serve published snapshots (POST /admin/reload, SIGHUP)")
    p.add_argument("--allow-url-inputs", dest="allow_url_inputs", action="store_true", default=argparse.SUPPRESS,
                   help="let /v1/embeddings fetch http(s) URL inputs (public addresses only, no redirects)")
    return {k: v for k, v in vars(p.parse_args(argv)).items()}


def main(argv: Sequence[str] | None = None) -> int:
    overrides = parse_args(argv)
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        print(f"msn-serve: invalid settings:\n{e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its CPU-feature probing is noise
    print(f"msn-serve settings: {settings.banner()}", file=sys.stderr, flush=True)
    if settings.device == "cuda":  # before the bundle is read or the port bound: one line, what is missing, the fix
        why = cuda_refusal()
        if why:
            print(f"msn-serve: {why}", file=sys.stderr)
            return 2

    import uvicorn

    from msn_serve.http.app import create_app
    from msn_serve.http.server import uvicorn_options
    from msn_serve.runtime import Runtime
    from msn_serve.workers.launch import choose_http_workers, serve_with_workers

    try:
        runtime = Runtime(settings)
        app = create_app(settings, runtime)
        front_end = choose_http_workers(settings.http_workers, runtime)
    except (OSError, ValueError) as e:  # msn_core.bundle.BundleError is a ValueError
        print(f"msn-serve: cannot start: {e}", file=sys.stderr)
        return 2
    print(f"msn-serve front end: {front_end.describe()}", file=sys.stderr, flush=True)
    if front_end.count == 0:
        runtime.front_end = front_end.describe
        uvicorn.run(app, **uvicorn_options(settings))
        return 0
    return serve_with_workers(app, runtime, overrides, front_end)


if __name__ == "__main__":
    raise SystemExit(main())

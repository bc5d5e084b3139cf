"""Service settings: one pydantic-settings model fed by ``MSN_SERVE_*`` environment variables and CLI flags.

Keeping every knob in one typed object means the start-up banner, the CLI and the tests all agree on names and
defaults, and the API key can never leak into logs (it is a ``SecretStr`` and is redacted when printed). The checks
the services share against these limits live here too (:func:`check_results`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from msn_core.lowshot import DEFAULT_LAMBD
from msn_serve.errors import too_large


class Settings(BaseSettings):
    """All serving options. CLI flags override environment variables, which override defaults."""

    model_config = SettingsConfigDict(env_prefix="MSN_SERVE_", extra="forbid")

    # One bundle (``PATH``, served as model ``default``) or several (``NAME=PATH``, the first is the default model);
    # the environment variable may hold a comma-separated list (docs/serving.md, "Several models").
    bundle: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="exported bundle directory (model.onnx + msn.json), or NAME=PATH, "
                                          "repeatable (the first is the default model)")
    models_dir: Path | None = Field(None, description="every subfolder holding msn.json is a model named after it "
                                                       "(re-read on SIGHUP by the writer)")
    data_dir: Path = Field(Path("msn-data"), description="where classifiers and indexes are persisted")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key_file: Path | None = Field(None, description="file holding the Bearer API key; unset = no auth")
    api_key: SecretStr | None = Field(None, description="API key given directly (prefer api_key_file)")
    api_keys_file: Path | None = Field(None, description="keys file: 'scopes key-or-sha256:digest [name]' per line, "
                                                          "re-read on change or SIGHUP (docs/serving.md)")
    device: Literal["cpu", "cuda", "auto"] = Field(
        "cpu", description="cuda refuses to start unless onnxruntime-gpu, a GPU build of faiss and a GPU are "
                           "all here; auto = cuda when they are, else cpu (msn_serve.device)")
    fp16: bool = Field(True, description="on CUDA, run an fp16 variant of the model (fp32 inputs/outputs)")
    precision: Literal["auto", "fp32", "int8", "bf16"] = Field(
        "auto", description="auto = the fastest that passes the accuracy gate on this CPU, measured at start-up; "
                            "int8 = the bundle's guarded quantized graph (msn-export --quantize int8); bf16 = "
                            "OpenVINO on CPUs with bf16 units (docs/serving.md, 'Runtime and precision')")
    runtime: Literal["auto", "onnxruntime", "openvino"] = Field(
        "auto", description="CPU inference runtime; auto = whichever is faster here (with --precision)")
    max_batch_size: int = Field(32, ge=1, le=4096)
    # An idle engine runs what is queued at once; while it is busy the next batch fills (msn_serve.embedding.batcher).
    max_wait_ms: float = Field(0.0, ge=0.0, le=10_000.0, description="how long the first image waits for company "
                                                                     "when the engine is idle (0: run at once)")
    queue_size: int = Field(512, ge=1, description="images waiting for inference before new ones get 503")
    max_body_mb: float = Field(32.0, gt=0.0)
    max_image_pixels: int = Field(40_000_000, ge=1, description="decoded width*height limit (bomb guard)")
    max_images_per_request: int = Field(256, ge=1)
    # Request limits (docs/serving.md, "Limits"): each refusal is a 413/422 naming the setting. Together they bound
    # what one request can make the server hold in memory, whatever a client sends.
    max_request_pixels: int = Field(100_000_000, ge=1, description="decoded pixels summed over one request's "
                                                                    "images (413 beyond)")
    max_vectors_per_request: int = Field(10_000, ge=1, description="vectors/embeddings in one add, fit or predict")
    max_queries_per_search: int = Field(1_000, ge=1, description="query vectors or images in one search")
    max_k: int = Field(10_000, ge=1, description="largest k of a search or a prediction")
    max_results_per_request: int = Field(100_000, ge=1, description="queries x k (k capped at the index size or "
                                                                    "class count) in one search or prediction")
    max_metadata_bytes: int = Field(65_536, ge=2, description="JSON bytes of one id's metadata")
    max_index_metadata_mb: float = Field(256.0, gt=0.0, description="JSON bytes of all metadata of one index")
    max_response_mb: float = Field(64.0, gt=0.0, description="response body size (413 beyond)")
    max_label_chars: int = Field(256, ge=1, description="characters in one few-shot label")
    max_fit_samples: int = Field(20_000, ge=2, description="examples in one few-shot fit")
    max_fit_classes: int = Field(1_000, ge=2, description="distinct labels in one few-shot fit")
    # The label loop (docs/serving.md, "Label loop"): select/suggest sample their candidates, so they answer in
    # bounded time at any index size; a predict_index page is bounded like a search result.
    select_candidates: int = Field(20_000, ge=1, description="items select/suggest consider: a seeded sample of "
                                                              "the index beyond this")
    max_select: int = Field(1_000, ge=1, description="largest n of a select or suggest request")
    max_page: int = Field(10_000, ge=1, description="largest limit of a predict_index page")
    # Few-shot fits run in worker processes, so a long fit never holds the serving process's GIL.
    fit_workers: int = Field(1, ge=1, le=64, description="fit worker processes (fits running at once)")
    # Uploads are decoded and preprocessed on CPU threads. On a CPU engine they share the cores with inference, so
    # two; beside a GPU they are what bounds HTTP throughput (a GPU run served 476 images/s with two while the
    # engine ran thousands), so every core.
    preprocess_threads: int = Field(0, ge=0, le=256, description="threads decoding and preprocessing uploads "
                                                                 "(0: 2 on cpu, every core on cuda)")
    # Worker processes decode beside the event loop instead of threads inside it: no GIL shared with the HTTP
    # parsing (docs/serving.md, "Front end", has the measurements behind the default).
    preprocess_workers: int = Field(0, ge=0, le=256, description="worker processes decoding uploads instead of "
                                                                 "threads (0: threads, --preprocess-threads)")
    # HTTP worker processes around one engine process (msn_serve.workers, docs/serving.md "HTTP worker processes"):
    # the front end of a fast engine runs on every core instead of one interpreter's.
    http_workers: str = Field("0", description="HTTP processes: N, auto (decided from the engine and the cores; "
                                              "/readyz says why) or 0 (one process serves HTTP)")
    http_worker_slots: int = Field(256, ge=1, le=65535, description="image slots in shared memory per HTTP process, "
                                                                     "at least max_images_per_request (images in "
                                                                     "flight; beyond, 503 + Retry-After)")
    max_queued_fits: int = Field(4, ge=0, description="fits waiting for a worker before new ones get 503")
    fit_timeout_s: float = Field(300.0, gt=0.0, description="a fit running longer is stopped (422)")
    # Connections (uvicorn): slow or idle clients cannot hold the server's sockets forever.
    timeout_headers_s: float = Field(10.0, gt=0.0, description="close a connection whose request headers have "
                                                                "not arrived this long after it opened or went idle")
    timeout_keep_alive_s: float = Field(5.0, gt=0.0, description="close an idle keep-alive connection after this")
    max_connections: int = Field(1024, ge=1, description="open connections; beyond, new ones get 503 + "
                                                          "Retry-After and are closed")
    http: Literal["auto", "httptools", "h11"] = Field("auto", description="HTTP parser: httptools (C) when "
                                                                          "installed, else h11")
    intra_op_threads: int = Field(0, ge=0, description="ONNX Runtime intra-op threads; 0 = physical cores")
    fit_threads: int = Field(1, ge=1, description="threads of each cyanure fit (in its worker process)")
    default_lambd: float = Field(DEFAULT_LAMBD, gt=0.0, description="few-shot L2 strength before division by n "
                                                                     "(default: the low-shot protocol's)")
    wal_compact_mb: float = Field(64.0, gt=0.0, description="snapshot an index once its WAL exceeds this")
    # A second index backend (docs/serving.md, "Milvus backend"): per index ("backend" at create) or by default.
    index_backend: Literal["faiss", "milvus"] = Field("faiss", description="where a new index goes unless its "
                                                                          "create names a backend")
    milvus_uri: str | None = Field(None, description="Milvus of milvus-backed indexes: a Milvus Lite file PATH.db "
                                                     "(embedded, one process at a time; default "
                                                     "<data-dir>/milvus.db) or a server URL http://host:19530")
    log_level: str = "info"
    # Replica consistency (docs/deploy.md): one writer publishes snapshots, read-only replicas load them.
    role: Literal["writer", "reader"] | None = Field(None, description="reader = read_only (the k8s manifests' name)")
    read_only: bool = Field(False, description="refuse writes (403); serve the latest published snapshot")
    reload_poll_s: float = Field(0.0, ge=0.0, description="reader: check published/CURRENT this often; 0 = only on "
                                                           "POST /admin/reload or SIGHUP")
    publish_interval_s: float = Field(0.0, ge=0.0, description="writer: publish a snapshot this often when the "
                                                                "state changed; 0 = only on POST /admin/snapshot")
    publish_keep: int = Field(3, ge=1, description="published versions kept (older ones after a grace period)")
    # URL inputs of POST /v1/embeddings (docs/serving.md, "OpenAI-compatible API"): the server fetches only when
    # the operator says so, only public addresses, no redirects, bounded in bytes and time.
    allow_url_inputs: bool = Field(False, description="fetch http(s) URL inputs of /v1/embeddings")
    url_max_mb: float = Field(16.0, gt=0.0, description="largest image fetched from a URL input (413 beyond)")
    url_timeout_s: float = Field(10.0, gt=0.0, description="time allowed for fetching one URL input (400 beyond)")

    @model_validator(mode="after")
    def _role(self) -> Settings:
        if self.read_only and self.role == "writer":
            raise ValueError("read_only=true contradicts role=writer")
        if self.precision in ("int8", "bf16") and self.device == "cuda":
            raise ValueError(f"precision {self.precision} is the bundle's CPU graph; on device cuda the fp16 "
                             "variant is served (or fp32 with fp16=false)")
        if self.runtime == "openvino" and self.device == "cuda":
            raise ValueError("runtime openvino is CPU-only here; device cuda runs ONNX Runtime's CUDA provider")
        return self

    @field_validator("bundle", mode="before")
    @classmethod
    def _bundles(cls, v: Any) -> list[str]:
        """A path, a comma-separated text (the environment variable) or a list of ``PATH`` / ``NAME=PATH``."""
        if isinstance(v, (str, Path)):
            v = [v]
        if not isinstance(v, (list, tuple)):
            raise ValueError("expected a bundle path, NAME=PATH, or a list of them")  # noqa: TRY004
        out = []
        for item in v:
            out += [part.strip() for part in str(item).split(",") if part.strip()] if isinstance(item, str) \
                else [str(item)]
        return out

    @field_validator("http_workers", mode="before")
    @classmethod
    def _http_workers(cls, v: Any) -> str:
        text = str(v).strip().lower()
        if text != "auto" and not (text.isdigit() and int(text) <= 256):
            raise ValueError("expected a number of HTTP processes (0-256) or auto")
        return text

    @property
    def reader(self) -> bool:
        return self.read_only or self.role == "reader"

    @field_validator("data_dir", "api_key_file", "api_keys_file", "models_dir", mode="after")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return None if v is None else v.expanduser()

    def model_specs(self) -> list[ModelSpec]:
        """The models to load at start-up: ``--bundle`` ones in order, then the models directory's (by name);
        ``ValueError`` naming the problem (no model, a bad or repeated name)."""
        specs = [parse_bundle_spec(text, single=len(self.bundle) == 1) for text in self.bundle]
        if self.models_dir is not None:
            specs += models_in(self.models_dir)
        if not specs:
            raise ValueError("no model to serve: give --bundle PATH, --bundle NAME=PATH (repeatable) or --models-dir")
        seen: set[str] = set()
        for spec in specs:
            if spec.name in seen:
                raise ValueError(f"model name {spec.name!r} given twice")
            seen.add(spec.name)
        return specs

    def resolved_api_key(self) -> str | None:
        """The configured key (file wins over the direct value); stripped of the trailing newline editors add."""
        if self.api_key_file is not None:
            key = self.api_key_file.read_text(encoding="utf-8").strip()
            if not key:
                raise ValueError(f"API key file {self.api_key_file} is empty")
            return key
        if self.api_key is not None:
            return self.api_key.get_secret_value() or None
        return None

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    @property
    def max_response_bytes(self) -> int:
        return int(self.max_response_mb * 2**20)

    @property
    def max_index_metadata_bytes(self) -> int:
        return int(self.max_index_metadata_mb * 2**20)

    def banner(self) -> str:
        """Settings as printed at start-up, secrets redacted."""
        data = self.model_dump(mode="json")
        if data.get("api_key") is not None:
            data["api_key"] = "***redacted***"
        data["auth"] = ("scoped keys" if self.api_keys_file else "bearer" if (self.api_key_file or self.api_key)
                        else "off")
        return json.dumps(data, sort_keys=True)


def check_results(queries: int, k: int, limit: int) -> None:
    """413 when ``queries`` x ``k`` results (k already capped at what exists) exceed ``limit``
    (:attr:`Settings.max_results_per_request`): a client controls ``queries x k``, the operator caps it, and the
    services check it before any work."""
    if queries * k > limit:
        raise too_large(f"{queries} queries x k={k} = {queries * k} results exceed the limit of {limit} "
                        "(max_results_per_request); send fewer queries or a smaller k")


DEFAULT_MODEL = "default"  # the name of a single bundle given without one
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class ModelSpec:
    """A model to serve: its name, its bundle directory, and where it came from (``bundle``: the command line or the
    environment; ``dir``: the models directory, re-read on SIGHUP; ``admin``: ``PUT /admin/models``)."""

    name: str
    bundle: Path
    source: str = "bundle"


def check_model_name(name: str) -> str:
    """``name`` if it is a valid model name (``ValueError`` otherwise): path-safe, and not a bare ``.`` or ``..``,
    which URL normalisation would eat from ``/v2/models/{name}``."""
    if not MODEL_NAME_RE.fullmatch(name) or set(name) == {"."}:
        raise ValueError(f"invalid model name {name[:80]!r}: must match {MODEL_NAME_RE.pattern} and not be only dots")
    return name


def parse_bundle_spec(text: str, *, single: bool = True) -> ModelSpec:
    """``NAME=PATH`` or ``PATH`` (named ``default`` when it is the only bundle, else after its folder)."""
    name, sep, path = text.partition("=")
    if sep and MODEL_NAME_RE.fullmatch(name):
        return ModelSpec(check_model_name(name), Path(path).expanduser())
    path_ = Path(text).expanduser()
    return ModelSpec(DEFAULT_MODEL if single else check_model_name(path_.name), path_)


def models_in(directory: Path) -> list[ModelSpec]:
    """Every subfolder of ``directory`` that holds ``msn.json``, by name (``ValueError`` if it is no directory)."""
    if not directory.is_dir():
        raise ValueError(f"models directory {directory} does not exist or is not a directory")
    return [ModelSpec(check_model_name(p.name), p, "dir") for p in sorted(directory.iterdir())
            if p.is_dir() and (p / "msn.json").is_file() and not p.name.startswith(".")]

"""Which runtime and precision serve the bundle on this machine: the fastest candidate that passes its gate.

The machines this project runs on differ in what their CPUs can do (AVX2 only; AVX512-BF16/VNNI; AMX), and the
fastest way to run a ViT differs with them: ONNX Runtime fp32 or int8, OpenVINO fp32, int8 or bf16. Rather than a
table of assumptions, ``msn-serve --precision auto`` (the default) measures at start-up:

1. **Candidates**: every (runtime, precision) pair allowed by the flags that can run here. bf16 needs bf16 matrix
   units (:mod:`msn_core.hardware`, simulated with ``MSN_CPU_FLAGS``) and OpenVINO; int8 needs the bundle's int8
   graph, which exists only if it passed the export-time accuracy guard (cosine >= 0.99 to fp32 on held-out
   images, low-shot within 1 point); OpenVINO runs it only in QDQ form. Each exclusion is reported with its reason.
2. **Gate**: each candidate embeds probe images (uniform noise in the bundle's normalisation, unmasked and with half
   the patches dropped) and must reach cosine >= 0.99 to ONNX Runtime fp32 on every one, the export guard's
   threshold. (bf16 keeps fp32 accumulation; the gate catches a runtime that computes something else.)
3. **Timing**: images/s at the batch ``min(max_batch_size, 8)`` with the configured threads, median of >= 3 runs
   and >= 1 s after a warm-up; the fastest gated candidate is served.

The outcome is cached in the data directory (keyed by bundle, CPU, threads, batch, request and runtime versions), so
a restart on the same machine builds one engine and measures nothing. ``/readyz``, ``/info`` and ``/metrics``
report the choice and every candidate's figures.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.bundle import BundleInfo
from msn_core.durable import atomic_write_json
from msn_core.hardware import CpuInfo, cpu_info
from msn_core.inference import openvino_capabilities, openvino_status
from msn_serve.embedding.engine import Engine, InferenceEngine, OpenVinoEngine

log = logging.getLogger("msn_serve.embedding.choice")

RUNTIMES = ("onnxruntime", "openvino")
PRECISIONS = ("fp32", "int8", "bf16")
CHOICE_FILE = "runtime-choice.json"
MIN_COSINE = 0.99  # the export-time int8 guard's threshold
TIMING_BATCH = 8


@dataclass(frozen=True)
class Candidate:
    runtime: str
    precision: str

    @property
    def name(self) -> str:
        return f"{self.runtime}/{self.precision}"


@dataclass
class RuntimeChoice:
    """How the served engine was chosen, as ``/readyz`` and ``/info`` report it."""

    runtime: str
    precision: str
    how: str  # requested | measured | cached | cuda
    cpu: dict[str, Any]
    batch: int | None = None
    candidates: dict[str, dict[str, Any]] = field(default_factory=dict)  # measured: images_per_s, cosine_min
    excluded: dict[str, str] = field(default_factory=dict)  # candidate -> why it was not considered

    def describe(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Request:
    """The serving flags the choice depends on."""

    precision: str = "auto"
    runtime: str = "auto"
    threads: int = 0
    max_batch_size: int = 32


def plan(info: BundleInfo, request: Request, cpu: CpuInfo) -> tuple[list[Candidate], dict[str, str]]:
    """The candidates allowed by ``request`` that can run here, and every other pair with the reason it cannot."""
    precisions = PRECISIONS if request.precision == "auto" else (request.precision,)
    runtimes = RUNTIMES if request.runtime == "auto" else (request.runtime,)
    # OpenVINO is loaded only when it may run: it is not imported at all for --runtime onnxruntime.
    ov_ok, ov_why = openvino_status() if "openvino" in runtimes else (False, "not asked for")
    caps = openvino_capabilities() if ov_ok else frozenset()
    keep: list[Candidate] = []
    excluded: dict[str, str] = {}
    for runtime in runtimes:
        for precision in precisions:
            c = Candidate(runtime, precision)
            why = _why_not(c, info, cpu, ov_ok, ov_why, caps)
            if why is None:
                keep.append(c)
            else:
                excluded[c.name] = why
    return keep, excluded


def _why_not(c: Candidate, info: BundleInfo, cpu: CpuInfo, ov_ok: bool, ov_why: str,
             caps: frozenset[str]) -> str | None:
    if c.runtime == "openvino" and not ov_ok:
        return ov_why
    if c.precision == "int8":
        if info.int8 is None:
            return (f"bundle {info.model_id} has no int8 graph; add one with msn-export --bundle "
                    f"{info.path or 'DIR'} --quantize int8")
        if c.runtime == "openvino" and info.int8.method != "qdq":
            return (f"OpenVINO runs int8 graphs in QDQ form; this bundle's is {info.int8.method!r} "
                    "(re-quantize with --quantize-method qdq)")
    if c.precision == "bf16":
        if c.runtime == "onnxruntime":
            return "ONNX Runtime's CPU provider has no bf16 kernels for this graph; OpenVINO serves bf16"
        if not cpu.bf16_native:
            return f"this CPU ({cpu.model}) has no bf16 matrix units (amx_bf16 or avx512_bf16)"
        if "BF16" not in caps:
            return f"OpenVINO does not offer bf16 on this CPU (capabilities {sorted(caps)})"
    return None


def build_engine(c: Candidate, info: BundleInfo, threads: int) -> InferenceEngine:
    if c.runtime == "openvino":
        return OpenVinoEngine(info, precision=c.precision, intra_op_threads=threads)
    return Engine(info, intra_op_threads=threads, precision=c.precision)


def probe_inputs(info: BundleInfo, batch: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Uniform-noise images in the bundle's normalisation, all patches kept and half of them kept."""
    rng = np.random.default_rng(seed)
    pre = info.preprocessing
    raw = rng.random((batch, info.in_chans, info.image_size, info.image_size), dtype=np.float32)
    mean = np.asarray(pre.mean, np.float32)[: info.in_chans, None, None]
    std = np.asarray(pre.std, np.float32)[: info.in_chans, None, None]
    pixels = (raw - mean) / std
    n = info.num_patches
    full = np.tile(np.arange(n, dtype=np.int64), (batch, 1))
    half = np.sort(np.stack([rng.permutation(n)[: max(1, n // 2)] for _ in range(batch)]), axis=1)
    return [(pixels, full), (pixels, half)]


def min_cosine(engine: InferenceEngine, reference: list[np.ndarray],
               probes: list[tuple[np.ndarray, np.ndarray]]) -> float:
    worst = 1.0
    for ref, (pixels, keep) in zip(reference, probes, strict=True):
        out = engine.run(pixels, keep).astype(np.float64)
        if not np.isfinite(out).all():
            return float("nan")
        a = ref.astype(np.float64)
        cos = (a * out).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(out, axis=1), 1e-12)
        worst = min(worst, float(cos.min()))
    return worst


def images_per_second(engines: dict[str, InferenceEngine], pixels: np.ndarray, keep: np.ndarray, seconds: float,
                      rounds: int = 3) -> dict[str, float]:
    """Median images/s of each engine over ``rounds`` interleaved rounds of >= ``seconds / rounds`` each.

    Interleaving makes a machine that slows down midway (another process, a clock change) slow every candidate
    alike: timed one after another, close candidates swapped places between start-ups on a 2-core AVX2 EPYC.
    Each engine first runs once at this shape (OpenVINO's first runs at a shape are markedly slower than its
    steady state).
    """
    for engine in engines.values():
        engine.run(pixels, keep)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            deadline = time.perf_counter() + seconds / rounds
            while True:
                t0 = time.perf_counter()
                engine.run(pixels, keep)
                times[name].append(time.perf_counter() - t0)
                if time.perf_counter() >= deadline:
                    break
    return {name: len(pixels) / float(np.median(t)) for name, t in times.items()}


def _cache_key(info: BundleInfo, request: Request, cpu: CpuInfo, batch: int) -> str:
    import onnxruntime as ort

    ov_ok, ov_why = openvino_status() if request.runtime != "onnxruntime" else (False, "")
    key = {"model_id": info.model_id, "int8": info.int8.method if info.int8 else None, "cpu": cpu.model,
           "flags": sorted(cpu.flags), "cores": cpu.cores, "request": asdict(request), "batch": batch,
           "onnxruntime": ort.__version__, "openvino": ov_why if ov_ok else None}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def choose_engine(info: BundleInfo, request: Request, *, cache_dir: Path | None = None,
                  seconds: float = 3.0, cpu: CpuInfo | None = None) -> tuple[InferenceEngine, RuntimeChoice]:
    """Build the engine to serve with; :class:`ValueError` (a clean start-up error) when nothing can run."""
    cpu = cpu or cpu_info()
    candidates, excluded = plan(info, request, cpu)
    if not candidates:
        raise ValueError(f"cannot serve --precision {request.precision} --runtime {request.runtime}: "
                         + "; ".join(f"{name}: {why}" for name, why in excluded.items()))
    batch = min(request.max_batch_size, TIMING_BATCH)
    cache_path = cache_dir / CHOICE_FILE if cache_dir is not None else None
    key = _cache_key(info, request, cpu, batch)
    cached = _read_cache(cache_path).get(key) if cache_path is not None else None
    if cached is not None and Candidate(cached["runtime"], cached["precision"]) in candidates:
        try:
            engine = build_engine(Candidate(cached["runtime"], cached["precision"]), info, request.threads)
            log.info("serving %s/%s as measured before on this machine (%s)", cached["runtime"],
                     cached["precision"], cache_path)
            return engine, RuntimeChoice(**{**cached, "how": "cached"})
        except Exception as e:  # noqa: BLE001 - a stale entry: measure again
            log.warning("cached runtime choice %s/%s failed to load (%s); measuring again", cached["runtime"],
                        cached["precision"], e)
    engine, choice = _measure(info, request, cpu, candidates, excluded, batch, seconds)
    if cache_path is not None and choice.how == "measured":
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(cache_path, {**_read_cache(cache_path), key: choice.describe()})
        except OSError as e:  # a read-only cache directory costs a measurement per start, nothing else
            log.warning("cannot cache the runtime choice in %s: %s", cache_path, e)
    return engine, choice


def _measure(info: BundleInfo, request: Request, cpu: CpuInfo, candidates: list[Candidate],
             excluded: dict[str, str], batch: int, seconds: float) -> tuple[InferenceEngine, RuntimeChoice]:
    """Gate and time every candidate (or only gate the one candidate an explicit request leaves)."""
    probes = probe_inputs(info, batch)
    reference_engine = Engine(info, intra_op_threads=request.threads, precision="fp32")
    reference = [reference_engine.run(p, k) for p, k in probes]
    timed = len(candidates) > 1
    figures: dict[str, dict[str, Any]] = {}
    passed: dict[str, tuple[Candidate, InferenceEngine]] = {}
    for c in candidates:
        try:
            engine = reference_engine if c == Candidate("onnxruntime", "fp32") else build_engine(
                c, info, request.threads)
        except Exception as e:  # noqa: BLE001 - e.g. OpenVINO cannot compile this graph: not a candidate
            excluded[c.name] = f"failed to load: {e}"
            continue
        cosine = 1.0 if engine is reference_engine else min_cosine(engine, reference, probes)
        finite = bool(np.isfinite(cosine))  # NaN (non-finite outputs) fails the gate and is reported as null
        figures[c.name] = {"cosine_min": round(cosine, 5) if finite else None,
                           "passed": finite and cosine >= MIN_COSINE}
        if figures[c.name]["passed"]:
            passed[c.name] = (c, engine)
        else:
            excluded[c.name] = f"cosine to ONNX Runtime fp32 {cosine:.4f} < {MIN_COSINE} on probe images"
    speeds = images_per_second({n: e for n, (_, e) in passed.items()}, *probes[0], seconds) if timed and passed \
        else {}
    for name, speed in speeds.items():
        figures[name]["images_per_s"] = round(speed, 2)
    best = max(((speeds.get(n, 0.0), c, e) for n, (c, e) in passed.items()), key=lambda t: t[0], default=None)
    if best is None:
        raise ValueError("no runtime passed the accuracy gate: "
                         + "; ".join(f"{name}: {why}" for name, why in excluded.items()))
    _, chosen, engine = best
    log.info("runtime choice: %s (%s)", chosen.name,
             ", ".join(f"{n} {f.get('images_per_s', '-')} img/s" for n, f in figures.items()))
    return engine, RuntimeChoice(chosen.runtime, chosen.precision, "measured" if timed else "requested",
                                 cpu.describe(), batch if timed else None, figures, excluded)

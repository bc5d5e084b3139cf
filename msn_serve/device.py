"""Which device ``msn-serve`` runs on: ``cpu``, ``cuda`` (refused with the reason when it cannot work) or ``auto``.

A GPU path that cannot work used to start and serve on the CPU with a warning in the log, so a user found out from
the throughput. Now ``--device cuda`` checks every piece the GPU path needs before the bundle is read or the port
bound: ONNX Runtime's CUDA provider (``onnxruntime-gpu``), a GPU build of FAISS (``faiss-gpu-cuvs``, the ``gpu``
extra's; ``faiss-gpu`` passes too) and a GPU the NVIDIA driver sees. A missing piece stops the start with one line
naming it and the install that brings it.
``--device auto`` takes the GPU when every piece is there and the CPU otherwise, and says which and why (log,
``/readyz``, ``/info``). The checks allocate nothing and time nothing (:mod:`msn_core.gpu`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from msn_core.gpu import CudaUnavailable, cuda_driver_problem, ort_cuda_problem
from msn_core.optional import GPU_INSTALL, MissingDependency, require

__all__ = ["DeviceChoice", "DeviceUnavailable", "cuda_problems", "cuda_refusal", "resolve_device"]

DEVICES = ("cpu", "cuda", "auto")


# ``--device cuda`` cannot work here; the message is the one line to print (a ValueError: a clean start-up error
# wherever :func:`msn_serve.http.app.create_app` is called).
DeviceUnavailable = CudaUnavailable


@dataclass(frozen=True)
class DeviceChoice:
    """The device served on and why (``/readyz`` and ``/info`` report both)."""

    requested: str
    device: str
    reason: str

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def faiss_problem(version: str, has_gpu_build: bool) -> str | None:
    """Why FAISS ``version`` cannot put indexes on a GPU because of its build (None: it has GPU support)."""
    return None if has_gpu_build else f"faiss-gpu-cuvs (this faiss {version} is the CPU build)"


def cuda_problems() -> tuple[list[str], str | None]:
    """``(packages missing, driver problem)`` for serving on CUDA: each package clause names the GPU build needed
    and the CPU build installed; the driver clause says why no GPU is visible. Both empty/None: CUDA can work."""
    missing: list[str] = []
    for gpu_build, check in (("onnxruntime-gpu", ort_cuda_problem), ("faiss-gpu-cuvs", _faiss_cuda_problem)):
        try:
            why = check()
        except MissingDependency as e:
            why = f"{gpu_build} ({e.module} is not installed)"
        if why:
            missing.append(why)
    return missing, cuda_driver_problem()


def _faiss_cuda_problem() -> str | None:
    faiss = require("faiss", "--device cuda")
    return faiss_problem(faiss.__version__, hasattr(faiss, "StandardGpuResources"))


def refusal(missing: list[str], driver: str | None) -> str | None:
    """The one line ``--device cuda`` stops with, from :func:`cuda_problems`' answer (None: nothing is missing)."""
    parts = []
    if missing:
        parts.append(f"needs {' and '.join(missing)}: {GPU_INSTALL}")
    if driver:
        parts.append(driver)
    return "--device cuda " + "; and ".join(parts) if parts else None


def cuda_refusal() -> str | None:
    """:func:`refusal` for this machine."""
    return refusal(*cuda_problems())


def resolve_device(requested: str, *, precision: str = "auto", runtime: str = "auto") -> DeviceChoice:
    """The device for ``--device requested``: :class:`DeviceUnavailable` when ``cuda`` cannot work; ``auto`` takes
    CUDA only when nothing is missing and the flags do not ask for a CPU-only precision or runtime."""
    if requested not in DEVICES:
        raise ValueError(f"--device {requested!r}: expected one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return DeviceChoice("cpu", "cpu", "--device cpu")
    if requested == "auto" and (precision in ("int8", "bf16") or runtime == "openvino"):
        why = f"--precision {precision}" if precision in ("int8", "bf16") else f"--runtime {runtime}"
        return DeviceChoice("auto", "cpu", f"{why} runs on the CPU only")
    why = cuda_refusal()
    if requested == "cuda":
        if why:
            raise DeviceUnavailable(why)
        return DeviceChoice("cuda", "cuda",
                            "--device cuda: onnxruntime-gpu, a GPU build of faiss and a GPU are all here")
    if why:
        return DeviceChoice("auto", "cpu", why.replace("--device cuda ", "cuda ", 1))
    return DeviceChoice("auto", "cuda", "onnxruntime-gpu, a GPU build of faiss and a GPU are all here")

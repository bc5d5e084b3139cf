"""Optional libraries: which extra installs each, and the one error a missing one raises.

Each install is a subset of the project (``pip install 'msn[serve]'`` has no torch, ``'msn[train]'`` no FAISS), so
code reaches a library outside its install's promise through :func:`require` (fail with the fix), :func:`optional`
(a silent fallback, e.g. no progress bar without tqdm) or :func:`available` (a check without importing). The error
says what needed the library and which ``pip install`` brings it, the same way everywhere::

    --format parquet needs pyarrow, which is not installed: pip install pyarrow
    msn-visualize app needs gradio, which is not installed: pip install 'msn[viz]'

The extras are pyproject.toml's; ``tests/core/test_core_optional.py`` checks this table against it.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["EXTRAS", "GPU_INSTALL", "MissingDependency", "available", "install_hint", "missing", "optional", "require"]

# import name -> (distribution, extras that install it: the first is the one to suggest). No extra: pip install it.
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "torch": ("torch", ("train", "viz")),
    "training": ("msn", ("train",)),  # the package is there in a checkout; what it needs is torch
    "kornia": ("kornia", ("train",)),
    "safetensors": ("safetensors", ("train",)),
    "onnx": ("onnx", ("train", "serve")),
    "onnxscript": ("onnxscript", ("train",)),
    "onnxruntime": ("onnxruntime", ("serve", "train", "gpu")),
    "openvino": ("openvino", ("serve",)),
    "faiss": ("faiss-cpu", ("serve", "gpu")),
    "cyanure": ("cyanure", ("serve", "train")),
    "sklearn": ("scikit-learn", ("train",)),
    "tqdm": ("tqdm", ("train",)),
    "tensorboard": ("tensorboard", ("train",)),
    "matplotlib": ("matplotlib", ("train", "viz")),
    "fastapi": ("fastapi", ("serve",)),
    "uvicorn": ("uvicorn", ("serve",)),
    "httptools": ("httptools", ("serve",)),
    "uvloop": ("uvloop", ("serve",)),
    "httpx": ("httpx", ("client", "serve", "viz")),
    "diffusers": ("diffusers", ("viz",)),
    "gradio": ("gradio", ("viz",)),
    "skimage": ("scikit-image", ("viz",)),
    "pyarrow": ("pyarrow", ()),
    "onnxconverter_common": ("onnxconverter-common", ()),
    "pymilvus": ("pymilvus", ("milvus",)),
    "milvus_lite": ("milvus-lite", ("milvus",)),
}
# The GPU builds install under the CPU builds' import names (onnxruntime, faiss), so no import name above can say
# which one is there: the serving install that brings onnxruntime-gpu and faiss-gpu-cuvs (CUDA 13) is pyproject's
# `gpu` extra, installed instead of `serve`.
GPU_INSTALL = "pip install 'msn[gpu]' (instead of 'msn[serve]')"


class MissingDependency(ImportError):
    """An optional library is missing (or broken); the message names what needed it and the install that fixes it."""

    def __init__(self, message: str, *, module: str):
        super().__init__(message, name=module)
        self.module = module


def install_hint(module: str) -> str:
    """The command that installs ``module``: its extra (``pip install 'msn[serve]'``) or the package itself."""
    top = module.split(".")[0]
    distribution, extras = EXTRAS.get(top, (top, ()))
    if not extras:
        return f"pip install {distribution}"
    also = " and ".join(f"msn[{extra}]" for extra in extras[1:])
    return f"pip install 'msn[{extras[0]}]'" + (f" (also part of {also})" if also else "")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):  # a blocking import hook raises: as good as absent
        return False


def available(module: str) -> bool:
    """Whether ``module``'s package is installed, without importing it (e.g. before starting a subprocess)."""
    return _installed(module)


def missing(module: str, purpose: str) -> str | None:
    """The error :func:`require` would raise, as text, when ``module`` is not installed; None when it is."""
    return None if _installed(module) else f"{purpose} needs {module.split('.')[0]}, which is not installed: " \
        f"{install_hint(module)}"


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (dotted names too); :class:`MissingDependency` saying what ``purpose`` needs and how to
    install it when it is absent, or that it is installed but broken (its own error quoted)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        why = missing(module, purpose)
        if why is None:
            why = f"{purpose} needs {module}, which is installed but cannot be imported ({e})"
        raise MissingDependency(why, module=module) from e


def optional(module: str) -> ModuleType | None:
    """``module``, or None when it cannot be imported: for a feature that quietly does without it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None

"""What the serving benchmarks share: a tiny random bundle, test JPEGs, percentiles, and a real ``msn-serve``
subprocess on a free loopback port (started from any source tree, so a fix can be measured against the code before).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def tiny_bundle(out: Path) -> Path:
    import torch

    from training.bundle.export import export_bundle
    from training.model.vit import VisionTransformer
    torch.manual_seed(0)
    enc = VisionTransformer(image_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4)
    export_bundle(enc, out, arch="vit_tiny", parity_check=False,
                  preprocessing={"resize": 36, "crop": 32, "mean": [0.5] * 3, "std": [0.5] * 3, "channels": 3,
                                 "interpolation": "bicubic"})
    return out


def test_images(n: int, seed: int = 0) -> list[bytes]:
    import io

    from PIL import Image
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        arr = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).resize((320, 240)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


# ---- (2)+(3) HTTP ----------------------------------------------------------------------------------------------------
def start_server(bundle: Path, data: Path, args: list[str], src: Path = REPO,
                 launcher: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """``msn-serve`` from the source tree ``src`` (this one by default) on a free port, once ready; ``launcher``
    replaces ``-m msn_serve`` (e.g. to run it under cProfile)."""
    import socket

    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pythonpath = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, *(launcher or ["-m", "msn_serve"]), "--bundle", str(bundle),
                             "--data-dir", str(data), "--port", str(port), "--log-level", "warning", *args], cwd=src,
                            env={**os.environ, "PYTHONPATH": pythonpath},
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode())
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError("server did not become ready")


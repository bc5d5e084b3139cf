"""Helpers for the serving tests: real ``python -m msn_serve`` subprocesses and test images."""
from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
PREPROCESSING = {"resize": 36, "crop": 32, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
                 "channels": 3, "interpolation": "bicubic"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``python -m msn_serve`` subprocess; ``url`` once :meth:`start` returned."""

    def __init__(self, bundle: Path, data_dir: Path, *args: str, env: dict[str, str] | None = None,
                 launcher: list[str] | None = None):
        """``launcher``: what runs instead of ``-m msn_serve`` (a script that ends up in ``msn_serve.cli.main``)."""
        self.bundle, self.data_dir, self.args, self.env = bundle, data_dir, list(args), env or {}
        self.launcher = launcher or ["-m", "msn_serve"]
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}-server.log"

    def start(self, timeout: float = 60.0, expect_ready: bool = True) -> Server:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MSN_SERVE_")}
        env.update({"PYTHONUNBUFFERED": "1", **self.env})
        # Pinned to ONNX Runtime fp32 unless a test asks otherwise: most tests compare embeddings with the fp32
        # graph at tight tolerances, and --precision auto's choice depends on timing (test_runtime_choice.py).
        pinned = [] if {"--precision", "--runtime"} & set(self.args) else ["--precision", "fp32",
                                                                          "--runtime", "onnxruntime"]
        # MSN_TEST_HTTP_WORKERS=N runs every server of the suite with N HTTP worker processes (docs/serving.md).
        workers = os.environ.get("MSN_TEST_HTTP_WORKERS")
        if workers and "--http-workers" not in self.args:
            pinned += ["--http-workers", workers]
        cmd = [sys.executable, *self.launcher, "--bundle", str(self.bundle), "--data-dir", str(self.data_dir),
               "--port", str(self.port), "--intra-op-threads", "1", "--max-wait-ms", "2", *pinned, *self.args]
        self._log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"msn-serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.url}/readyz", timeout=2)
                if r.status_code == 200 or (not expect_ready and r.status_code in (200, 503)):
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"msn-serve not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, **{"timeout": 60, **kw})

    def memory_kb(self, field: str = "VmHWM") -> int:
        """The server process's ``/proc`` memory figure (``VmHWM``: peak resident set; ``VmRSS``: current)."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if hasattr(self, "_log") and not self._log.closed:
            self._log.close()


def encode(im: Image.Image | np.ndarray, fmt: str = "PNG", **save) -> bytes:
    """Image (or uint8 array) -> file bytes in ``fmt``."""
    if isinstance(im, np.ndarray):
        im = Image.fromarray(im)
    buf = io.BytesIO()
    im.save(buf, format=fmt, **save)
    return buf.getvalue()


def random_image(seed: int, h: int = 40, w: int = 48) -> np.ndarray:
    """Smooth-ish random colour image (resize-sensitive but not pure noise)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(max(2, h // 4), max(2, w // 4), 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR))


# A liveness bound, not a latency target: /healthz answered in 4-50 ms on an idle 2-core machine and 145 ms at p99
# (235 ms max) with a light second load on it; an event loop held by a parse or a fit holds a poll for the whole of
# it (seconds). The healthy figures are measured by benchmarks/serving/serve_hostile.py, not here.
LIVENESS_P99_S = 1.0


def assert_live(health: list[float], request_s: float, what: str) -> None:
    """``/healthz`` kept answering while ``what`` ran for ``request_s`` seconds: enough polls, their p99 under
    :data:`LIVENESS_P99_S`, and no poll held for half the request (what a loop blocked by the request would do)."""
    p99 = float(np.percentile(health, 99))
    figures = (f"/healthz p99 {p99 * 1000:.0f} ms (max {max(health) * 1000:.0f} ms) over {len(health)} polls "
               f"during {what} of {request_s:.2f} s")
    assert len(health) >= 10, figures
    assert p99 < LIVENESS_P99_S and max(health) < max(LIVENESS_P99_S, 0.5 * request_s), figures

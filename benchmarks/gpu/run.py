"""The prepared GPU run: every GPU figure of the project in one command, essential ones first, as files.

Run on the GPU machine after ``benchmarks/gpu/install.sh`` (docs/gpu-run.md), from the repository root:

    PYTHONPATH=/tmp/msn-gpu/payload/site python3 -m benchmarks.gpu.run --out $OUT --deadline 480

Stages, in order (each in its own process with its own time limit; a stage that cannot finish before the
deadline is skipped and says so; every stage's result is written as soon as it ends, so a run cut short still
returns what it measured):

1. ``env``: GPU, driver, torch, ONNX Runtime and its providers (and whether a CUDA session really runs on CUDA).
2. ``tests``: the CUDA-marked tests (``pytest -m cuda``).
3. ``serving``: :mod:`benchmarks.gpu.serving` (ORT CUDA fp32/fp16, IOBinding, CPU provider, torch reference, HTTP).
4. ``training``: :mod:`benchmarks.gpu.training` (ours beside the official step, fp32/bf16, MFU).
5. ``faiss_gpu``: :mod:`benchmarks.gpu.faiss_gpu` (flat, IVF-Flat and CAGRA on 10^6 x 384 vectors on the GPU beside
   FAISS on the host's cores, queries/s at recall@10 >= 0.95), when a GPU build of faiss is importable: the optional
   FAISS payload (``python -m benchmarks.gpu.pack --faiss-gpu``, ``install.sh faiss``), whose ``faiss/site`` the
   stage puts first on its own PYTHONPATH; skipped with the reason otherwise. After the ONNX Runtime and training
   figures: FAISS is the smaller share of a serving request's time, and its payload costs calls of its own.
6. ``frontend``: :mod:`benchmarks.serving.frontend_bench` on the host's cores (1, 2, 4, 8; threads and worker
   processes): how the serving front end scales with cores where a GPU makes the engine cheap. It needs no GPU, so
   it comes after every GPU figure.
7. ``faiss``: the CPU FAISS index through msn-serve's tuner (:mod:`benchmarks.serving.faiss_bench`); ``faiss_gpu``'s
   CPU rows cover the same host when it runs, so this one is last.

``--dry-run`` runs the same stages on the CPU with tiny sizes and the CUDA parts skipped with their reason: the
test suite runs it, so the GPU run cannot fail on a typo.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import REPO, save_json

CUDA_TESTS = ["tests/gpu", "tests/training/test_views.py"]


def sh(cmd: list[str], timeout: float, log: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd`` from the repo root, appending its output to ``log``; (exit code, last lines)."""
    t0 = time.monotonic()
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout, env={**(env or os.environ), "PYTHONUNBUFFERED": "1"}, check=False)
            out, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, code = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""), 124
        f.write(out)
        f.write(f"[exit {code} after {time.monotonic() - t0:.0f} s]\n")
    return code, "\n".join(out.strip().splitlines()[-15:])


def env_stage() -> dict:
    """What the machine has, and whether ONNX Runtime's CUDA provider really runs a session on the GPU."""
    info: dict = {}
    try:
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                             "--format=csv,noheader"], capture_output=True, text=True,
                                            check=False).stdout.strip()
    except FileNotFoundError:
        info["nvidia_smi"] = None
    import onnxruntime as ort

    info["onnxruntime"] = {"version": ort.__version__, "file": ort.__file__,
                           "providers": ort.get_available_providers()}
    try:
        import torch
        info["torch"] = {"version": torch.__version__, "cuda": torch.cuda.is_available(),
                         "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    except ImportError:
        info["torch"] = None
    return info


def faiss_gpu_env(site: Path) -> tuple[dict[str, str], str | None]:
    """The faiss_gpu stage's environment (``site`` first on PYTHONPATH when it exists) and why the stage must be
    skipped (no GPU build of faiss importable there, or no GPU visible to it), or None."""
    env = dict(os.environ)
    if site.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    probe = ("import faiss; gpu = hasattr(faiss, 'StandardGpuResources'); "
             "print(faiss.__version__, gpu, faiss.get_num_gpus() if gpu else 0)")
    try:
        r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return env, "importing faiss took over 120 s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return env, f"faiss does not import with {site} on the path: {last}"
    version, gpu, count = r.stdout.split()
    if gpu != "True":
        where = site if site.is_dir() else f"{site} (absent)"
        return env, (f"faiss {version} is a CPU build and no GPU build is at {where}: carry the FAISS payload "
                     "(python -m benchmarks.gpu.pack --faiss-gpu; bash benchmarks/gpu/install.sh faiss)")
    if int(count) == 0:
        return env, f"faiss {version} is a GPU build but sees no GPU"
    return env, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for the results (the device tool's $OUT)")
    ap.add_argument("--deadline", type=float, default=480, help="seconds for the whole run")
    ap.add_argument("--official", type=Path, default=Path(os.environ.get("MSN_GPU_STORE", "/tmp/msn-gpu"))
                    / "early" / "official_msn", help="the official src/ (benchmarks.gpu.pack puts it there)")
    ap.add_argument("--faiss-site", type=Path, default=Path(os.environ.get("MSN_GPU_STORE", "/tmp/msn-gpu"))
                    / "faiss" / "site", help="the FAISS GPU payload's tree (install.sh faiss puts it there)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, CUDA parts skipped with the reason")
    ap.add_argument("--only", nargs="+", choices=["tests", "serving", "training", "faiss_gpu", "frontend", "faiss"])
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    start, log = time.monotonic(), a.out / "gpu_run.log"
    summary_path = a.out / "gpu_run.json"
    summary: dict = {"dry_run": a.dry_run, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages": {}}
    summary["env"] = env_stage()
    save_json(summary_path, summary)
    py = sys.executable
    quick = ["--quick", "--device", "cpu"] if a.dry_run else []
    # faiss_gpu: 10^6 x 384 (1.5 GB) generated on every core, exact truth on the CPU, flat / IVF / CAGRA each way.
    tiny_faiss = ["--n", "4000", "--queries", "100", "--min-seconds", "0.02"] if a.dry_run else []
    # frontend: 4 core counts x 2 modes x (8 s timed + ~4 s to start and probe) ~ 100 s; it writes its JSON at the
    # end, so it runs whole or not at all. 16 cores is left out: the load generator runs on the same host and would
    # share the server's cores (8 stay free for it at 8). Threads (one process) against HTTP worker processes: how
    # each added HTTP process adds to the rate.
    # The dry run measures one configuration, HTTP worker processes (threads: tests/serve/test_decode_pool.py).
    frontend = (["--cores", "1", "--seconds", "0.25", "--clients", "4", "--client-procs", "1", "--modes", "http"]
                if a.dry_run else ["--cores", "1,2,4,8", "--seconds", "8", "--clients", "64", "--client-procs", "4",
                                   "--modes", "threads,http"])
    stages = [  # (name, command, seconds it needs at least, seconds it may take)
        ("tests", [py, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-rs", *CUDA_TESTS], 30, 150),
        ("serving", [py, "-m", "benchmarks.gpu.serving", "--out", str(a.out / "serving.json"), *quick], 60, 200),
        # the dry run times no CPU attention kernels (a CUDA run never does: its bf16 rows are SDPA)
        ("training", [py, "-m", "benchmarks.gpu.training", "--out", str(a.out / "training.json"),
                      "--official", str(a.official), *quick, *(["--cpu-attention", "sdpa"] if a.dry_run else [])],
         60, 220),
        ("faiss_gpu", [py, "-m", "benchmarks.gpu.faiss_gpu", "--out", str(a.out / "faiss_gpu.json"), *tiny_faiss],
         60, 150),
        ("frontend", [py, "-m", "benchmarks.serving.frontend_bench", *frontend, "--out", str(a.out / "frontend.json")],
         20 if a.dry_run else 100, 150),
        ("faiss", [py, "-m", "benchmarks.serving.faiss_bench", "--n", "2000" if a.dry_run else "1000000",
                   "--corpora", "clustered", "--kinds", "ivf", "ivfpq", "--out", str(a.out / "faiss.json")], 30, 150),
    ]
    for name, cmd, least, most in stages:
        if a.only and name not in a.only:
            continue
        left = a.deadline - (time.monotonic() - start)
        env, why = faiss_gpu_env(a.faiss_site) if name == "faiss_gpu" else (None, None)
        if name == "frontend" and a.faiss_site.is_dir():  # msn_serve imports faiss: a FAISS-payload session's
            env = dict(os.environ)                         # only one is the GPU build (after faiss-cpu if present)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(a.faiss_site)]))
        if why:
            summary["stages"][name] = {"skipped": why}
        elif left < least:
            summary["stages"][name] = {"skipped": f"{left:.0f} s left of the deadline, needs {least}"}
        else:
            t0 = time.monotonic()
            code, tail = sh(cmd, min(most, left), log, env)
            summary["stages"][name] = {"exit": code, "seconds": round(time.monotonic() - t0, 1), "tail": tail}
        print(f"gpu run: {name}: {json.dumps(summary['stages'][name])[:400]}", flush=True)
        save_json(summary_path, summary)
    summary["seconds"] = round(time.monotonic() - start, 1)
    save_json(summary_path, summary)
    failed = [n for n, s in summary["stages"].items() if s.get("exit", 0) != 0]
    print(f"gpu run: done in {summary['seconds']:.0f} s; " + (f"failed: {failed}" if failed else "no stage failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

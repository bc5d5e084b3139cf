"""FAISS on the GPU against FAISS on the same host's CPU cores: flat, IVF-Flat and CAGRA on N x D vectors.

The corpus is :mod:`benchmarks.serving.faiss_bench`'s ``clustered`` one (N/1000 Gaussian clusters around
unit-normal centres, noise 0.5 per dimension; queries are corpus points moved by 0.1 per dimension), generated in
blocks on every core (10^6 x 384 float32 is 1.5 GB: one core would take a good part of the stage) and L2-normalised,
searched by inner product, k = 10. Truth: exact search on the CPU over all queries (which also times the CPU flat
row). Each knob (IVF ``nprobe``, CAGRA ``itopk_size``) is swept on 1,000 *tuning* queries; the smallest setting
reaching recall@10 >= the target is then measured on 1,000 other *evaluation* queries: recall and batched
queries/s (all queries in one call, repeated for at least ``--min-seconds``), and queries/s one query at a time.

Rows, in order of value (the JSON is rewritten after each, so a stage cut short keeps what it measured):

1. ``flat``: exact search, CPU (every core) and GPU (``index_cpu_to_gpu``, fp32).
2. ``ivf``: one IVF-Flat structure (``nlist`` as ``msn-index build`` picks it), trained and filled on the GPU when
   there is one (on the CPU otherwise), searched on the CPU and from its GPU copy made the way ``msn-serve --device
   cuda`` makes it (:func:`msn_serve.indexes.gpu.to_gpu`: FAISS' classic GPU kernels).
3. ``cagra``: cuVS' graph index (``faiss.GpuIndexCagra``), when this FAISS build has it.
4. ``ivf`` on cuVS' IVF-Flat kernels (the same structure cloned with ``use_cuvs``), when this build has them.

Without a GPU build of faiss (or with no GPU visible to it) the GPU rows are skipped with the reason and the CPU
rows still run, so a dry run on the CPU checks the code:

    python -m benchmarks.gpu.faiss_gpu --out faiss_gpu.json                   # 10^6 x 384 (the GPU run)
    python -m benchmarks.gpu.faiss_gpu --n 4000 --queries 200 --out /tmp/f.json   # a smoke run on any machine
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.durable import atomic_write_json

K = 10
NPROBES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ITOPK = (16, 32, 64, 128, 256, 512)


def clustered(n: int, dim: int, queries: int, seed: int = 0, workers: int | None = None) -> tuple[np.ndarray,
                                                                                                  np.ndarray]:
    """``faiss_bench.clustered``'s distribution, generated in blocks on ``workers`` threads (numpy's generators
    release the GIL while they fill an array): the same corpus for the same seed and worker count."""
    workers = workers or len(os.sched_getaffinity(0))
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(16, n // 1000), dim)).astype(np.float32)
    labels = rng.integers(0, len(centres), n)
    data = np.empty((n, dim), dtype=np.float32)
    bounds = np.linspace(0, n, workers + 1).astype(int)
    streams = np.random.SeedSequence(seed).spawn(workers)

    def block(i: int) -> None:
        lo, hi = bounds[i], bounds[i + 1]
        np.take(centres, labels[lo:hi], axis=0, out=data[lo:hi])
        noise = np.random.default_rng(streams[i]).standard_normal((hi - lo, dim), dtype=np.float32)
        noise *= 0.5
        data[lo:hi] += noise

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(block, range(workers)))
    q = data[rng.integers(0, n, queries)] + 0.1 * rng.standard_normal((queries, dim), dtype=np.float32)
    return data, q


def timed_qps(search, q: np.ndarray, min_seconds: float) -> float:
    """Batched queries/s: ``search(q)`` after one warm-up, repeated until ``min_seconds`` have passed."""
    search(q[: min(len(q), 32)])
    runs, t0 = 0, time.perf_counter()
    while True:
        search(q)
        runs += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return runs * len(q) / elapsed


def one_at_a_time_qps(search, q: np.ndarray, seconds: float = 1.0, most: int = 200) -> float:
    """Queries/s with one query per call (what a server answering single requests sees), for up to ``most``
    queries or ``seconds``."""
    search(q[:1])
    done, t0 = 0, time.perf_counter()
    while done < min(most, len(q)):
        search(q[done:done + 1])
        done += 1
        if time.perf_counter() - t0 >= seconds:
            break
    return done / (time.perf_counter() - t0)


def sweep(name: str, device: str, knob: str, values: tuple[int, ...], search_at, tune_q: np.ndarray,
          tune_t: np.ndarray, eval_q: np.ndarray, eval_t: np.ndarray, target: float, min_seconds: float) -> dict:
    """Sweep ``knob`` over ``values`` on the tuning queries (stopping once recall passes 0.99), then measure the
    smallest value reaching ``target`` on the evaluation queries."""
    from msn_serve.indexes.tuning import recall

    curve: list[dict[str, Any]] = []
    chosen = None
    for v in values:
        search = search_at(v)
        r = recall(search(tune_q), tune_t)
        curve.append({knob: v, "recall": round(r, 4), "qps": round(timed_qps(search, tune_q, min_seconds / 4), 1)})
        if chosen is None and r >= target:
            chosen = v
        if r >= 0.99:
            break
    chosen = chosen if chosen is not None else curve[-1][knob]
    search = search_at(chosen)
    row = {"kind": name, "device": device, knob: chosen, "recall": round(recall(search(eval_q), eval_t), 4),
           "qps": round(timed_qps(search, eval_q, min_seconds), 1),
           "qps_one_query_per_call": round(one_at_a_time_qps(search, eval_q, min(1.0, 2 * min_seconds)), 1),
           "tuning_curve": curve}
    print(f"faiss_gpu: {name} {device} {knob}={chosen}: recall {row['recall']}, {row['qps']:,.0f} q/s batched, "
          f"{row['qps_one_query_per_call']:,.0f} q/s one at a time", flush=True)
    return row


def machine() -> dict[str, Any]:
    """The host and GPU, as :func:`benchmarks.common.machine` records them but without importing torch: torch would
    load the image's CUDA runtime into this process beside the one faiss carries."""
    import platform
    import shutil
    import subprocess

    from msn_core.hardware import cpu_info

    cpu = cpu_info().describe()
    gpu = None
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, check=False)
        gpu = (r.stdout.strip().splitlines() or [None])[0]
    return {"cpu": cpu["cpu_model"], "cpu_count": cpu["cores"], "cores_visible": len(os.sched_getaffinity(0)),
            "cpu_flags": cpu["cpu_flags"], "python": platform.python_version(), "gpu": gpu}


def gpu_state(faiss) -> tuple[bool, str]:
    """(FAISS can use a GPU, why not)."""
    if not hasattr(faiss, "StandardGpuResources"):
        return False, (f"faiss {faiss.__version__} is a CPU build (the GPU one travels as the optional payload of "
                       "python -m benchmarks.gpu.pack --faiss-gpu, docs/gpu-run.md)")
    try:
        n = faiss.get_num_gpus()
    except RuntimeError as e:
        return False, f"faiss.get_num_gpus() failed: {e}"
    return (True, "") if n > 0 else (False, "faiss is a GPU build but sees no GPU")


def run(n: int, dim: int, queries: int, target: float, min_seconds: float, out: Path | None,
        kinds: list[str]) -> dict:
    import faiss

    from msn_serve.indexes.tuning import nlist_for, recall

    gpu, why = gpu_state(faiss)
    result: dict[str, Any] = {
        "benchmark": "faiss_gpu", "n": n, "dim": dim, "k": K, "target_recall": target,
        "faiss": {"version": faiss.__version__, "file": faiss.__file__,
                  "compile_options": faiss.get_compile_options(), "omp_threads": faiss.omp_get_max_threads()},
        "gpu": gpu, "machine": machine(), "skipped": {}, "rows": [], "seconds": {}}
    if not gpu:
        result["skipped"]["gpu"] = why
        print(f"faiss_gpu: GPU rows skipped: {why}", flush=True)

    def save() -> None:
        if out is not None:
            atomic_write_json(out, result)

    t0 = time.perf_counter()
    data, q = clustered(n, dim, 2 * queries)
    faiss.normalize_L2(data)
    faiss.normalize_L2(q)
    result["seconds"]["generate"] = round(time.perf_counter() - t0, 2)
    tune_q, eval_q = q[:queries], q[queries:]
    t0 = time.perf_counter()
    _, truth = faiss.knn(q, data, K, metric=faiss.METRIC_INNER_PRODUCT)
    flat_s = time.perf_counter() - t0
    tune_t, eval_t = truth[:queries], truth[queries:]
    result["rows"].append({"kind": "flat", "device": "cpu", "recall": 1.0, "qps": round(len(q) / flat_s, 1)})
    print(f"faiss_gpu: {n} x {dim} generated in {result['seconds']['generate']} s; flat cpu "
          f"{len(q) / flat_s:,.0f} q/s", flush=True)
    save()
    res = faiss.StandardGpuResources() if gpu else None

    def cloner(use_cuvs: bool = False):
        options = faiss.GpuClonerOptions()
        options.useFloat16 = False
        if hasattr(options, "use_cuvs"):
            options.use_cuvs = use_cuvs
        return options

    def searcher(index, params=None):
        return lambda x: index.search(x, K, params=params)[1]

    if gpu and "flat" in kinds:
        t0 = time.perf_counter()
        flat = faiss.index_cpu_to_gpu(res, 0, faiss.IndexFlatIP(dim), cloner())
        flat.add(data)
        build = time.perf_counter() - t0
        row = {"kind": "flat", "device": "gpu", "recall": round(recall(searcher(flat)(eval_q), eval_t), 4),
               "qps": round(timed_qps(searcher(flat), eval_q, min_seconds), 1),
               "qps_one_query_per_call": round(one_at_a_time_qps(searcher(flat), eval_q, min(1.0, 2 * min_seconds)),
                                               1),
               "build_s": round(build, 2)}
        result["rows"].append(row)
        print(f"faiss_gpu: flat gpu: recall {row['recall']}, {row['qps']:,.0f} q/s batched", flush=True)
        del flat
        save()

    cpu_ivf = None
    if "ivf" in kinds:
        nlist = nlist_for(n)
        train = data[np.random.default_rng(1).permutation(n)[: 64 * nlist]]
        t0 = time.perf_counter()
        cpu_ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        if gpu:  # trained and filled on the GPU, copied back: the same structure for both devices
            staging = faiss.index_cpu_to_gpu(res, 0, cpu_ivf, cloner())
            staging.train(train)
            staging.add(data)
            cpu_ivf = faiss.index_gpu_to_cpu(staging)
            del staging
        else:
            cpu_ivf.train(train)
            cpu_ivf.add(data)
        build = {"nlist": nlist, "train_points": len(train), "built_on": "gpu" if gpu else "cpu",
                 "build_s": round(time.perf_counter() - t0, 2)}
        result["ivf_build"] = build
        print(f"faiss_gpu: ivf nlist {nlist} built on the {build['built_on']} in {build['build_s']} s", flush=True)

        def ivf_cpu(nprobe: int):
            return searcher(cpu_ivf, faiss.SearchParametersIVF(nprobe=nprobe))

        result["rows"].append({**sweep("ivf", "cpu", "nprobe", NPROBES, ivf_cpu, tune_q, tune_t, eval_q, eval_t,
                                       target, min_seconds), **build})
        save()
        if gpu:
            from msn_serve.indexes.gpu import to_gpu

            t0 = time.perf_counter()
            gpu_ivf = to_gpu(cpu_ivf)  # msn-serve --device cuda's copy (classic FAISS GPU kernels)
            copy_s = time.perf_counter() - t0

            def ivf_gpu(nprobe: int):
                gpu_ivf.nprobe = nprobe
                return searcher(gpu_ivf)

            result["rows"].append({**sweep("ivf", "gpu", "nprobe", NPROBES, ivf_gpu, tune_q, tune_t, eval_q,
                                           eval_t, target, min_seconds), "copy_to_gpu_s": round(copy_s, 2)})
            del gpu_ivf
            save()

    for name, row_fn in (("cagra", cagra_row), ("ivf-cuvs", cuvs_ivf_row)):
        if name.split("-")[0] not in kinds:
            continue
        try:
            row_fn(faiss, res, data, cpu_ivf, gpu, why, result, (tune_q, tune_t, eval_q, eval_t), target,
                   min_seconds)
        except Exception as e:  # noqa: BLE001 - an optional row's failure is recorded; the others still ran
            result["skipped"][name] = f"failed: {type(e).__name__}: {e}"
        if name in result["skipped"]:
            print(f"faiss_gpu: {name} skipped: {result['skipped'][name]}", flush=True)
        save()
    summary = {}
    for row in result["rows"]:
        if row["recall"] >= target:
            summary[f"{row['kind']}/{row['device']}"] = row["qps"]
    result["qps_at_target"] = summary
    save()
    return result


def cagra_row(faiss, res, data: np.ndarray, cpu_ivf, gpu: bool, why: str, result: dict, queries: tuple,
              target: float, min_seconds: float) -> None:
    """cuVS' CAGRA graph (graph degree 32 pruned from 64, built with IVF-PQ), swept over ``itopk_size``."""
    if not gpu:
        result["skipped"]["cagra"] = why
        return
    if not hasattr(faiss, "GpuIndexCagra"):
        result["skipped"]["cagra"] = f"faiss {faiss.__version__} was built without cuVS (no GpuIndexCagra)"
        return
    config = faiss.GpuIndexCagraConfig()
    config.graph_degree, config.intermediate_graph_degree = 32, 64
    config.build_algo = faiss.graph_build_algo_IVF_PQ
    t0 = time.perf_counter()
    cagra = faiss.GpuIndexCagra(res, data.shape[1], faiss.METRIC_INNER_PRODUCT, config)
    cagra.train(data)
    build_s = time.perf_counter() - t0
    print(f"faiss_gpu: cagra built in {build_s:.1f} s", flush=True)

    def cagra_at(itopk: int):
        params = faiss.SearchParametersCagra()
        params.itopk_size = itopk
        return lambda x: cagra.search(x, K, params=params)[1]

    result["rows"].append({**sweep("cagra", "gpu", "itopk_size", ITOPK, cagra_at, *queries, target, min_seconds),
                           "build_s": round(build_s, 2), "graph_degree": 32, "intermediate_graph_degree": 64,
                           "build_algo": "IVF_PQ"})


def cuvs_ivf_row(faiss, res, data: np.ndarray, cpu_ivf, gpu: bool, why: str, result: dict, queries: tuple,
                 target: float, min_seconds: float) -> None:
    """The same IVF-Flat structure on cuVS' kernels (cloned with ``use_cuvs``) instead of FAISS' classic ones."""
    if cpu_ivf is None:
        return
    if not gpu:
        result["skipped"]["ivf-cuvs"] = why
        return
    options = faiss.GpuClonerOptions()
    if not hasattr(options, "use_cuvs") or "CUVS" not in faiss.get_compile_options():
        result["skipped"]["ivf-cuvs"] = "this faiss build has no cuVS kernels"
        return
    options.useFloat16, options.use_cuvs = False, True
    t0 = time.perf_counter()
    cuvs_ivf = faiss.index_cpu_to_gpu(res, 0, cpu_ivf, options)
    copy_s = time.perf_counter() - t0

    def ivf_cuvs(nprobe: int):
        cuvs_ivf.nprobe = nprobe
        return lambda x: cuvs_ivf.search(x, K)[1]

    result["rows"].append({**sweep("ivf-cuvs", "gpu", "nprobe", NPROBES, ivf_cuvs, *queries, target, min_seconds),
                           "copy_to_gpu_s": round(copy_s, 2)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--queries", type=int, default=1000, help="tuning queries, and as many evaluation queries")
    ap.add_argument("--target", type=float, default=0.95, help="recall@10 each knob is tuned to reach")
    ap.add_argument("--min-seconds", type=float, default=0.5, help="batched timing: repeat for at least this long")
    ap.add_argument("--kinds", nargs="+", default=["flat", "ivf", "cagra"], choices=["flat", "ivf", "cagra"])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    result = run(a.n, a.dim, a.queries, a.target, a.min_seconds, a.out, a.kinds)
    print(f"faiss_gpu: done in {time.perf_counter() - t0:.0f} s; queries/s at recall@10 >= {a.target}: "
          f"{result['qps_at_target']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``msn-embed`` on a folder of images against the offline engine, and a kill + restart of it.

Three measurements, printed and written as JSON with the machine:

1. **The offline engine**: the bundle's graph on the runtime ``msn-serve`` chooses here (measured once, then used by
   every row), on the same images already decoded and preprocessed into one array: images/s of ``engine.run``
   alone, at ``--batch-size``, measured before and after the ``msn-embed`` run (their mean is the reference).
2. **msn-embed**, the torch-free CLI in a subprocess whose import system refuses torch (a ``.[serve]`` install):
   images/s over the whole run as the manifest times it (listing, engine load, decoding, inference, writing) and
   over the process's wall time; the ratio to (1) is the figure to read.
3. **Resumability**: the same run killed (SIGKILL) once ``--kill-after`` shards are committed, restarted, and
   compared with the uninterrupted run of (2): same ids, same vectors, committed shards not redone.

    python -m benchmarks.serving.embed_folder                # 60k Fashion-MNIST PNGs of runs/flat_folder
    python -m benchmarks.serving.embed_folder --limit 500 --out /tmp/embed_folder.json   # a smoke test
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, RESULTS, machine, save_json

TORCH_FREE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'training'):
            raise ImportError('blocked: msn-embed must run without torch (' + name + ')')
sys.meta_path.insert(0, Block())
from msn_serve.corpus.cli import main
rc = main(sys.argv[1:])
assert 'torch' not in sys.modules, 'msn-embed imported torch'
sys.exit(rc)
"""


def offline_engine(engine, pixels: np.ndarray, batch: int) -> float:
    """images/s of ``engine.run`` over ``pixels`` (one warm-up batch first)."""
    keep = np.arange(engine.info.num_patches, dtype=np.int64)
    full = np.ascontiguousarray(np.broadcast_to(keep, (batch, keep.size)))
    engine.run(pixels[:batch], full[:len(pixels[:batch])])
    t0 = time.perf_counter()
    for lo in range(0, len(pixels), batch):
        x = pixels[lo:lo + batch]
        engine.run(x, full[:len(x)])
    return len(pixels) / (time.perf_counter() - t0)


def decode_all(files: list[str], pre, max_pixels: int) -> tuple[np.ndarray, float]:
    """The graph inputs of ``files`` (unreadable ones left out) and the single-thread decode rate."""
    from msn_serve.corpus.embed import decode_file

    t0 = time.perf_counter()
    arrays = [x for x in (decode_file(f, pre, max_pixels) for f in files) if not isinstance(x, str)]
    rate = len(files) / (time.perf_counter() - t0)
    return np.stack(arrays), rate


def msn_embed(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WORLD_SIZE": "1"}
    return subprocess.Popen([sys.executable, "-c", TORCH_FREE, *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, what: str) -> str:
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"embed_folder: {what} failed ({proc.returncode}):\n{err[-3000:]}")
    return err


def outputs(out: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    m = json.loads((out / "manifest.json").read_text())
    ids = np.concatenate([np.load(out / s["ids"]) for s in m["shards"]])
    vecs = np.concatenate([np.load(out / s["embeddings"]) for s in m["shards"] if s["count"]])
    return m, ids, vecs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=REPO / "runs" / "flat_folder" / "bundles" / "flat")
    p.add_argument("--images", type=Path, default=REPO / "runs" / "flat_folder" / "images")
    p.add_argument("--limit", type=int, default=0, help="only the first N images (0 = all)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--shards", type=int, default=6, help="the run is cut into this many shards")
    p.add_argument("--kill-after", type=int, default=2, help="committed shards before the kill")
    p.add_argument("--threads", type=int, default=0, help="inference threads (0 = every CPU)")
    p.add_argument("--work", type=Path, help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--out", type=Path, default=RESULTS / "embed_folder.json")
    args = p.parse_args(argv)

    from msn_core.bundle import load_bundle_info
    from msn_core.corpus import corpus_items
    from msn_core.sources import list_images
    from msn_serve.corpus.cli import MAX_IMAGE_PIXELS
    from msn_serve.embedding.choice import Request, choose_engine

    info = load_bundle_info(args.bundle)
    files = [f for _, _, f in corpus_items(list_images("auto", args.images))]
    files = files[:args.limit] if args.limit else files
    n = len(files)
    shard_size = max(args.batch_size, math.ceil(n / args.shards))
    engine, choice = choose_engine(info, Request(threads=args.threads, max_batch_size=args.batch_size))
    print(f"{n} images, runtime {choice.runtime}/{choice.precision} ({choice.how}), batch {args.batch_size}, "
          f"shards of {shard_size}")
    pixels, decode_rate = decode_all(files, info.preprocessing, MAX_IMAGE_PIXELS)
    before = offline_engine(engine, pixels, args.batch_size)
    print(f"offline engine: {before:,.1f} img/s on pre-decoded tensors; single-thread decode {decode_rate:,.0f} img/s")

    work = args.work or Path(tempfile.mkdtemp(prefix="embed_folder."))
    try:
        common = ["--bundle", str(args.bundle), "--data", str(args.images), "--runtime", choice.runtime,
                  "--precision", choice.precision, "--batch-size", str(args.batch_size), "--shard-size",
                  str(shard_size), "--threads", str(args.threads)]
        common += ["--limit", str(args.limit)] if args.limit else []
        full = work / "full"
        t0 = time.perf_counter()
        finish(msn_embed([*common, "--out", str(full)]), "msn-embed")
        wall = time.perf_counter() - t0
        m, ids, vecs = outputs(full)
        after = offline_engine(engine, pixels, args.batch_size)
        offline = (before + after) / 2
        run_rate, wall_rate = m["num_files"] / m["seconds"], m["num_files"] / wall
        print(f"msn-embed: {run_rate:,.1f} img/s over its run ({m['seconds']} s), {wall_rate:,.1f} img/s over the "
              f"process ({wall:.1f} s); offline engine {before:,.1f} before / {after:,.1f} after -> ratio "
              f"{run_rate / offline:.3f}")

        resumed = work / "resumed"
        proc = msn_embed([*common, "--out", str(resumed)])
        last = resumed / f"shard-{args.kill_after - 1:05d}.json"
        while not last.is_file() and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        committed = sorted(p.name for p in resumed.glob("shard-*.json"))
        stamps = {p.name: p.stat().st_mtime_ns for p in resumed.glob("shard-*")}
        killed_early = not (resumed / "manifest.json").exists()
        t0 = time.perf_counter()
        finish(msn_embed([*common, "--out", str(resumed)]), "msn-embed restart")
        restart_s = time.perf_counter() - t0
        redone = sorted(k for k, v in stamps.items() if (resumed / k).stat().st_mtime_ns != v)
        m2, ids2, vecs2 = outputs(resumed)
        same = bool(ids.tolist() == ids2.tolist() and vecs.shape == vecs2.shape and np.array_equal(vecs, vecs2))
        print(f"resume: killed with {len(committed)} shards committed (before the end: {killed_early}), restart "
              f"{restart_s:.1f} s, committed shards redone: {len(redone)}, same result: {same}")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    result = {
        "images": n, "folder": str(args.images), "bundle": info.model_id, "batch_size": args.batch_size,
        "shard_size": shard_size, "runtime": choice.describe(), "threads": args.threads,
        "offline_engine_images_per_s": {"before": round(before, 1), "after": round(after, 1),
                                        "mean": round(offline, 1)},
        "single_thread_decode_images_per_s": round(decode_rate, 1),
        "msn_embed": {"images_per_s_run": round(run_rate, 1), "images_per_s_process": round(wall_rate, 1),
                      "run_seconds": m["seconds"], "process_seconds": round(wall, 2), "count": m["count"],
                      "skipped": m["skipped"], "torch_imported": False},
        "ratio_to_offline_engine": round(run_rate / offline, 3),
        "ratio_to_offline_engine_process": round(wall_rate / offline, 3),
        "resume": {"kill_after_shards": args.kill_after, "committed_at_kill": len(committed),
                   "killed_before_the_end": killed_early, "committed_shards_redone": len(redone),
                   "restart_seconds": round(restart_s, 2), "count": m2["count"], "same_result": same},
        "machine": machine(),
    }
    save_json(args.out, result)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

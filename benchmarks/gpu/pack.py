"""Pack what the GPU run needs into parts that each fit one device call (run here, where PyPI is reachable).

The GPU machine has no network and a call carries at most 64 MiB, while ``onnxruntime-gpu`` alone is a ~255 MB
wheel. So: download the wheels the run needs for the machine's Python (cp312) that its image lacks, unpack them
into one ``site/`` tree (what ``pip install --target`` makes of them: a wheel is a zip of that tree), add the
official MSN step code (facebookresearch/msn ``src/``, from a local clone or the ``fetch`` mirror: it never enters
the package), tar and xz the lot into one payload, and split it into parts of ``--part-mib``, each in its own
folder ``.gpu/part-NN/`` with a copy of the manifest (sizes and sha256 of every part, of the whole payload and of
every source wheel). Unpacking first is what makes it fit: the wheels' deflate leaves the CUDA kernels nearly
uncompressed, while xz over the unpacked libraries shrinks them several-fold. Each call carries one folder;
``benchmarks/gpu/receive.sh`` keeps the parts under /tmp there, ``install.sh`` joins, checks and unpacks them.
``.gpu/`` is git-ignored.

``--faiss-gpu`` packs the optional second payload the same way, into ``.gpu/faiss-part-NN/``: FAISS' CUDA 13 build
(``faiss-gpu-cuvs``, the ``gpu`` extra's) with the cuVS stack it links (libcuvs, libraft, librmm, rapids-logger)
and a CUDA runtime as new as the one it was compiled with; the other CUDA 13 libraries it loads (cuBLAS, cuRAND,
nvJitLink, cuSOLVER, cuSPARSE, NVRTC, NCCL) are the GPU image's own, linked into the unpacked tree by
``install.sh faiss``. C++ headers, CMake files and static archives are left out (nothing loads them at run time).

    python -m benchmarks.gpu.pack                     # download, pack, split into .gpu/part-NN/
    python -m benchmarks.gpu.pack --wheels-only DIR   # reuse wheels already downloaded into DIR
    python -m benchmarks.gpu.pack --faiss-gpu         # the FAISS GPU payload: .gpu/faiss-part-NN/
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / ".gpu"
# What the GPU image lacks for the serving stack, the trainer and the tests (its package list: the device tool's
# KINDS.md); everything else (numpy, onnx, safetensors, httpx, pytest, PyYAML, ...) is there already.
WHEELS = ["onnxruntime-gpu==1.31.1", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "uvicorn", "httptools", "uvloop", "python-multipart", "pydantic-settings",
          "python-dotenv", "orjson", "faiss-cpu", "cyanure==1.2.2", "kornia", "kornia-rs",
          # fastapi >= 0.16x imports opentelemetry's API (it was missing from the first GPU run's payload)
          "opentelemetry-api", "importlib-metadata"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
OFFICIAL_FILES = ["src/deit.py", "src/losses.py", "src/utils.py", "src/msn_train.py", "src/data_manager.py",
                  "src/sgd.py", "LICENSE"]
# The optional FAISS GPU payload (--faiss-gpu). faiss-gpu-cuvs 1.15.1 asks (Requires-Dist) for nvidia-cuda-runtime,
# -cublas and -nvjitlink >= 13.2 and nvidia-curand >= 10.3.7; libcuvs/libraft for any CUDA 13 cuBLAS, cuRAND,
# cuSOLVER, cuSPARSE, NVRTC, nvJitLink and NCCL. The GPU image has the CUDA 13.0 set torch 2.11.0 pins
# (cuda-toolkit==13.0.2: runtime 13.0.96, cuBLAS 13.1.0.3, nvJitLink 13.0.88, cuRAND 10.4.0.35). Every symbol
# libfaiss, the SWIG module, libcuvs and libraft import from cudart, cuBLAS/cuBLASLt and nvJitLink is in those
# versions (checked with nm -D); libcuvs was compiled with CUDA 13.0.88 (its JIT-linked code matches the image's
# nvJitLink), libfaiss with 13.2.86, so only the runtime (2.3 MB) travels at the version it was built with. cuBLAS
# 13.2 would add a 444 MB wheel (several parts) for no symbol the image's lacks.
FAISS_GPU_WHEELS = ["faiss-gpu-cuvs==1.15.1", "libcuvs-cu13==26.6.0", "libraft-cu13==26.6.0", "librmm-cu13==26.6.0",
                    "rapids-logger==0.2.3", "nvidia-cuda-runtime==13.2.86"]
# Carried whole with the first part: what the training comparison needs beyond the GPU image, and the serving
# front end's pure stack (a few MiB), so that a session carrying the FAISS payload instead of the main one can still
# run the frontend stage (with faiss from that payload). The main payload keeps onnxruntime-gpu, faiss-cpu, cyanure.
EARLY = {"kornia", "kornia-rs", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
         "typing-inspection", "uvicorn", "httptools", "uvloop", "python-multipart", "pydantic-settings",
         "python-dotenv", "orjson", "opentelemetry-api", "importlib-metadata"}
# Room the first FAISS part leaves for the early archive when .gpu/early is not there to measure.
EARLY_RESERVE = 8 * 2**20
OFFICIAL_MIRROR = Path("/work/.mirror/facebookresearch+msn/repo")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def download(names: list[str], dest: Path, python_version: str = "3.12") -> None:
    """Binary wheels for the GPU machine's interpreter, without their dependencies (listed in WHEELS instead)."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + names, check=True)


def official_sources(repo: Path, dest: Path) -> str:
    """The official step code's files from a git directory (bare mirror or clone); returns its commit."""
    commit = subprocess.run(["git", "--git-dir", str(_git_dir(repo)), "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    for name in OFFICIAL_FILES:
        text = subprocess.run(["git", "--git-dir", str(_git_dir(repo)), "show", f"HEAD:{name}"], check=True,
                              capture_output=True).stdout
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(text)
    (dest / "COMMIT").write_text(commit + "\n")
    return commit


def _git_dir(repo: Path) -> Path:
    return repo / ".git" if (repo / ".git").exists() else repo


def unpack_wheels(wheels: Path, site: Path) -> dict[str, str]:
    """Unzip every wheel into ``site`` as ``pip install --target`` would lay it out; returns {wheel: sha256}.

    A wheel's ``NAME.data/purelib`` and ``platlib`` go to the top of ``site``; its scripts and headers are dropped
    (the run starts everything with ``python -m``).
    """
    hashes = {}
    site.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(wheels.glob("*.whl")):
        hashes[wheel.name] = sha256(wheel)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    for data in site.glob("*.data"):
        for lib in ("purelib", "platlib"):
            if (data / lib).is_dir():
                shutil.copytree(data / lib, site, dirs_exist_ok=True)
        shutil.rmtree(data)
    return hashes


def prune(site: Path) -> int:
    """Drop what nothing loads at run time: C++ headers (``PKG/include``, ``nvidia/cu13/include``), CMake package
    files and static archives. Returns the bytes removed."""
    doomed = [*site.glob("*/include"), *site.glob("nvidia/*/include"), *site.glob("*/lib64/cmake"),
              *site.glob("*/lib/cmake")]
    removed = 0
    for path in doomed:
        if path.is_dir():
            removed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path)
    for archive in site.rglob("*.a"):
        removed += archive.stat().st_size
        archive.unlink()
    return removed


def compress(root: Path, out: Path, level: int) -> None:
    """``root`` as ``out`` (tar + xz): the ``xz`` tool on every core where it is installed, else Python's lzma."""
    if shutil.which("xz") and shutil.which("tar"):
        with out.open("wb") as f:
            tar = subprocess.Popen(["tar", "-C", str(root.parent), "-cf", "-", root.name], stdout=subprocess.PIPE)
            subprocess.run(["xz", f"-{level}", "-T0"], stdin=tar.stdout, stdout=f, check=True)
            if tar.wait() != 0:
                raise RuntimeError("tar failed")
        return
    with tarfile.open(out, "w:xz", preset=level) as tar:
        tar.add(root, arcname=root.name)


def split(payload: Path, out: Path, part_bytes: int, meta: dict, first_part_bytes: int | None = None,
          prefix: str = "") -> dict:
    """``payload`` as ``out/{prefix}part-NN/payload.part`` files of at most ``part_bytes`` (the first one
    ``first_part_bytes``: it travels beside the early archive), each with the manifest. Only this payload's
    earlier folders are replaced: the other payload's stay."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{prefix}part-*"):
        shutil.rmtree(old)
    parts = []
    with payload.open("rb") as f:
        index = 0
        while chunk := f.read(first_part_bytes or part_bytes if index == 0 else part_bytes):
            folder = out / f"{prefix}part-{index:02d}"
            folder.mkdir()
            (folder / "payload.part").write_bytes(chunk)
            parts.append({"name": folder.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            index += 1
    manifest = {**meta, "payload_bytes": payload.stat().st_size, "payload_sha256": sha256(payload), "parts": parts}
    for p in parts:
        (out / p["name"] / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (out / f"{prefix}manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def pack(wheels: Path, official: Path | None, out: Path, part_mib: float, level: int) -> dict:
    """Two archives: ``early`` (the trainer's missing wheels and the official step code: a few MiB, carried whole
    with the first part, so the training comparison runs while the other parts travel) and the split payload."""
    with tempfile.TemporaryDirectory(prefix="msn-gpu-pack-") as tmp:
        early_wheels, late_wheels = Path(tmp) / "early-wheels", Path(tmp) / "late-wheels"
        early_wheels.mkdir()
        late_wheels.mkdir()
        for wheel in wheels.glob("*.whl"):
            early = wheel.name.split("-")[0].lower().replace("_", "-") in EARLY
            shutil.copy(wheel, (early_wheels if early else late_wheels) / wheel.name)
        early_root, root = Path(tmp) / "early", Path(tmp) / "payload"
        meta: dict = {"wheels": unpack_wheels(late_wheels, root / "site"),
                      "early_wheels": unpack_wheels(early_wheels, early_root / "site")}
        if official is not None:
            meta["official_msn_commit"] = official_sources(official, early_root / "official_msn")
        tar_path = Path(tmp) / "payload.tar.xz"
        compress(root, tar_path, level)
        early_tar = Path(tmp) / "early.tar.xz"
        compress(early_root, early_tar, level)
        meta["early_sha256"] = sha256(early_tar)
        part_bytes = int(part_mib * 2**20)
        manifest = split(tar_path, out, part_bytes, meta, first_part_bytes=part_bytes - early_tar.stat().st_size)
        shutil.rmtree(out / "early", ignore_errors=True)
        (out / "early").mkdir()
        shutil.copy(early_tar, out / "early" / "early.tar.xz")
        (out / "early" / "manifest.json").write_text(json.dumps(manifest, indent=1))
        return manifest


def pack_faiss_gpu(wheels: Path, out: Path, part_mib: float, level: int) -> dict:
    """The optional FAISS GPU payload: the wheels in ``wheels`` unpacked to ``faiss/site`` (headers, CMake files and
    static archives pruned), tar + xz, split into ``out/faiss-part-NN/`` (manifest ``faiss-manifest.json``). The
    first part is smaller by the early archive (``out/early``'s size, else ``EARLY_RESERVE``): a session that
    carries this payload instead of the main one sends the early archive with ``faiss-part-00``."""
    with tempfile.TemporaryDirectory(prefix="msn-gpu-faiss-") as tmp:
        root = Path(tmp) / "faiss"
        meta: dict = {"payload": "faiss", "root": "faiss", "wheels": unpack_wheels(wheels, root / "site")}
        unpacked = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        meta["pruned_bytes"] = prune(root / "site")
        meta["unpacked_bytes"] = unpacked - meta["pruned_bytes"]
        tar_path = Path(tmp) / "faiss.tar.xz"
        compress(root, tar_path, level)
        early = out / "early" / "early.tar.xz"
        part_bytes = int(part_mib * 2**20)
        reserve = min(early.stat().st_size if early.is_file() else EARLY_RESERVE, part_bytes // 2)
        return split(tar_path, out, part_bytes, meta, first_part_bytes=part_bytes - reserve, prefix="faiss-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--wheels-only", type=Path, metavar="DIR", help="pack the .whl files in DIR, no download")
    ap.add_argument("--official", type=Path, default=OFFICIAL_MIRROR,
                    help="git directory of facebookresearch/msn (a clone or the fetch tool's mirror)")
    ap.add_argument("--no-official", action="store_true", help="leave the official code out")
    ap.add_argument("--part-mib", type=float, default=59.0,
                    help="MiB a call carries beside the ~3 MiB tree (the first part is smaller by the early archive)")
    ap.add_argument("--xz-level", type=int, default=6)
    ap.add_argument("--faiss-gpu", action="store_true",
                    help="pack the optional FAISS GPU payload (FAISS_GPU_WHEELS) into .gpu/faiss-part-NN/ instead")
    a = ap.parse_args(argv)
    if a.faiss_gpu:
        with tempfile.TemporaryDirectory(prefix="msn-gpu-wheels-") as tmp:
            wheels = a.wheels_only or Path(tmp)
            if a.wheels_only is None:
                download(FAISS_GPU_WHEELS, wheels)
            manifest = pack_faiss_gpu(wheels, a.out, a.part_mib, a.xz_level)
        n = len(manifest["parts"])
        print(f"pack: faiss GPU payload: {sum(p['bytes'] for p in manifest['parts']) / 2**20:.1f} MiB in {n} parts "
              f"({manifest['unpacked_bytes'] / 2**20:.0f} MiB unpacked, {manifest['pruned_bytes'] / 2**20:.0f} MiB "
              f"of headers and archives left out), under {a.out}; send .gpu/faiss-part-00 ... faiss-part-{n - 1:02d}")
        return 0
    with tempfile.TemporaryDirectory(prefix="msn-gpu-wheels-") as tmp:
        wheels = a.wheels_only
        if wheels is None:
            wheels = Path(tmp)
            download(WHEELS, wheels)
        official = None if a.no_official else a.official
        if official is not None and not _git_dir(official).exists():
            sys.exit(f"pack: no git directory at {official} (use --official DIR or --no-official)")
        manifest = pack(wheels, official, a.out, a.part_mib, a.xz_level)
    total = manifest["payload_bytes"] / 2**20
    print(f"pack: {len(manifest['parts'])} parts, {total:.1f} MiB in all, under {a.out}; "
          f"send .gpu/part-00 ... part-{len(manifest['parts']) - 1:02d}, one per call (docs/gpu-run.md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

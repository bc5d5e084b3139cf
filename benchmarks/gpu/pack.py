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

    python -m benchmarks.gpu.pack                     # download, pack, split into .gpu/part-NN/
    python -m benchmarks.gpu.pack --wheels-only DIR   # reuse wheels already downloaded into DIR
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
          "typing-inspection", "uvicorn", "python-multipart", "pydantic-settings", "python-dotenv", "orjson",
          "faiss-cpu", "cyanure==1.2.2", "kornia", "kornia-rs",
          # fastapi >= 0.16x imports opentelemetry's API (it was missing from the first GPU run's payload)
          "opentelemetry-api", "importlib-metadata"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
OFFICIAL_FILES = ["src/deit.py", "src/losses.py", "src/utils.py", "src/msn_train.py", "src/data_manager.py",
                  "src/sgd.py", "LICENSE"]
# Carried whole with the first part: what the training comparison needs beyond the GPU image.
EARLY = {"kornia", "kornia-rs"}
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


def split(payload: Path, out: Path, part_bytes: int, meta: dict, first_part_bytes: int | None = None) -> dict:
    """``payload`` as ``out/part-NN/payload.part`` files of at most ``part_bytes`` (the first one
    ``first_part_bytes``: it travels beside the early archive), each with the manifest."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    parts = []
    with payload.open("rb") as f:
        index = 0
        while chunk := f.read(first_part_bytes or part_bytes if index == 0 else part_bytes):
            folder = out / f"part-{index:02d}"
            folder.mkdir()
            (folder / "payload.part").write_bytes(chunk)
            parts.append({"name": folder.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            index += 1
    manifest = {**meta, "payload_bytes": payload.stat().st_size, "payload_sha256": sha256(payload), "parts": parts}
    for p in parts:
        (out / p["name"] / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
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
        (out / "early").mkdir()
        shutil.copy(early_tar, out / "early" / "early.tar.xz")
        (out / "early" / "manifest.json").write_text(json.dumps(manifest, indent=1))
        return manifest


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
    a = ap.parse_args(argv)
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

#!/usr/bin/env bash
# On the GPU machine, once every part of a payload is stored (receive.sh says "all parts here"): join the parts,
# check the payload's sha256 against the manifest, unpack it to $MSN_GPU_STORE. Idempotent: a checked payload is kept.
#   bash benchmarks/gpu/install.sh         the main payload -> payload/site (the wheels), prints the PYTHONPATH
#   bash benchmarks/gpu/install.sh faiss   the optional FAISS GPU payload -> faiss/site, with the GPU image's own
#                                          CUDA 13 libraries linked into faiss/site/nvidia (the run's faiss_gpu
#                                          stage puts faiss/site first on its PYTHONPATH by itself)
set -euo pipefail
store=${MSN_GPU_STORE:-/tmp/msn-gpu}
case ${1:-payload} in
  payload) prefix="" label="" root=payload ;;
  faiss) prefix="faiss-" label="faiss: " root=faiss ;;
  *) echo "usage: install.sh [faiss]"; exit 2 ;;
esac
received=$(bash "$(dirname "$0")/receive.sh") || { echo "$received"; exit 1; }
grep -qx "receive: ${label}all parts here" <<<"$received" || { echo "$received"; exit 1; }
if [ ! -f "$store/$root/.checked" ]; then
  python3 - "$store" "$prefix" "$root" <<'PY'
import hashlib, json, sys, tarfile
from pathlib import Path
store, prefix, root = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
manifest = json.loads((store / f"{prefix}manifest.json").read_text())
h, joined = hashlib.sha256(), store / f"{root}.tar.xz"
with joined.open("wb") as out:
    for part in manifest["parts"]:
        data = (store / f"{prefix}parts" / part["name"]).read_bytes()
        h.update(data)
        out.write(data)
if h.hexdigest() != manifest["payload_sha256"]:
    sys.exit(f"install: joined payload sha256 {h.hexdigest()} != manifest {manifest['payload_sha256']}")
with tarfile.open(joined) as tar:
    # the "data" filter refuses links and paths out of the store, where this Python has it (3.12, 3.11.4+)
    tar.extractall(store, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
joined.unlink()
(store / root / ".checked").write_text(manifest["payload_sha256"] + "\n")
print(f"install: {root} {manifest['payload_bytes'] / 2**20:.1f} MiB checked and unpacked; "
      f"{len(manifest['wheels'])} wheels")
PY
fi
if [ "$root" = faiss ]; then
  # faiss-gpu-cuvs loads cuBLAS, cuRAND, nvJitLink (its preload, from nvidia/cu13/lib beside itself) and libcuvs
  # cuSOLVER, cuSPARSE, NVRTC, NCCL (RPATH $ORIGIN/../../nvidia/{cu13,nccl}/lib): link the image's own into the
  # tree, beside the carried CUDA runtime. Run without PYTHONPATH, so that `nvidia` is the image's.
  env -u PYTHONPATH python3 - "$store/faiss/site" <<'PY'
import json, sys
from importlib import metadata
from pathlib import Path
site = Path(sys.argv[1])
mine = site / "nvidia" / "cu13" / "lib"
mine.mkdir(parents=True, exist_ok=True)
found = {}
try:
    import nvidia  # the image's namespace package (torch's CUDA wheels)
    roots = [Path(p) for p in nvidia.__path__]
except ImportError:
    roots = []
linked = []
for root in roots:
    lib = root / "cu13" / "lib"
    for f in sorted(lib.glob("*.so*")) if lib.is_dir() else []:
        if not (mine / f.name).is_symlink() and not (mine / f.name).exists():
            (mine / f.name).symlink_to(f)
            linked.append(f.name)
    if (root / "nccl").is_dir() and not (site / "nvidia" / "nccl").is_symlink() and not (site / "nvidia" / "nccl").exists():
        (site / "nvidia" / "nccl").symlink_to(root / "nccl")
        linked.append("nccl/")
for name in ("nvidia-cuda-runtime", "nvidia-cublas", "nvidia-nvjitlink", "nvidia-curand", "nvidia-cusolver",
             "nvidia-cusparse", "nvidia-cuda-nvrtc", "nvidia-nccl-cu13"):
    try:
        found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        found[name] = None
(site.parent / "image-cuda.json").write_text(json.dumps({"image_versions": found, "linked": linked}, indent=1))
print(f"install: faiss: linked {len(linked)} of the image's CUDA libraries ({', '.join(linked[:12])}"
      f"{' ...' if len(linked) > 12 else ''}); image versions {json.dumps(found)}")
if not roots:
    print("install: faiss: the image has no nvidia/ CUDA wheels: faiss will look for its libraries on the loader path")
PY
  echo "install: faiss GPU build at $store/faiss/site (the faiss_gpu stage puts it first on its PYTHONPATH)"
else
  echo "install: export PYTHONPATH=$store/payload/site:$store/early/site\${PYTHONPATH:+:\$PYTHONPATH}"
fi

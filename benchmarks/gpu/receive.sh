#!/usr/bin/env bash
# On the GPU machine, every call of the prepared run (docs/gpu-run.md): keep the part(s) this call carried under
# $MSN_GPU_STORE (/tmp/msn-gpu: outside the copied tree, so it outlives the call while the machine stays warm),
# check each stored part against the manifest, and say which are still missing. Idempotent. Two payloads: the
# main one (.gpu/part-NN, stored in parts/, manifest.json) and the optional FAISS GPU one (.gpu/faiss-part-NN,
# stored in faiss-parts/, faiss-manifest.json); each is reported on its own, the main one last.
set -euo pipefail
store=${MSN_GPU_STORE:-/tmp/msn-gpu}
mkdir -p "$store"
shopt -s nullglob
for dir in .gpu/part-*/ .gpu/faiss-part-*/; do
  name=$(basename "$dir")
  prefix=${name%%part-*}  # "" (main payload) or "faiss-"
  mkdir -p "$store/${prefix}parts"
  cp "$dir/payload.part" "$store/${prefix}parts/$name.tmp" && mv "$store/${prefix}parts/$name.tmp" "$store/${prefix}parts/$name"
  cp "$dir/manifest.json" "$store/${prefix}manifest.json"
  echo "receive: stored $name"
done
if [ -f .gpu/early/early.tar.xz ] && [ ! -f "$store/early/.checked" ]; then
  # the early archive (trainer wheels + official step code) is unpacked at once: the training stage needs no more
  python3 - "$store" .gpu/early <<'PY'
import hashlib, json, sys, tarfile
from pathlib import Path
store, early = Path(sys.argv[1]), Path(sys.argv[2])
manifest = json.loads((early / "manifest.json").read_text())
data = (early / "early.tar.xz").read_bytes()
if hashlib.sha256(data).hexdigest() != manifest["early_sha256"]:
    sys.exit("receive: early.tar.xz does not match its sha256")
with tarfile.open(early / "early.tar.xz") as tar:
    tar.extractall(store, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
(store / "early" / ".checked").write_text(manifest["early_sha256"] + "\n")
print(f"receive: early archive unpacked: {', '.join(sorted(manifest['early_wheels']))}; official code "
      f"{manifest.get('official_msn_commit', 'absent')}")
PY
  cp .gpu/early/manifest.json "$store/manifest.json"
fi
[ -f "$store/manifest.json" ] || [ -f "$store/faiss-manifest.json" ] || {
  echo "receive: no manifest yet: carry a .gpu/part-NN or .gpu/faiss-part-NN folder"; exit 1; }
python3 - "$store" <<'PY'
import hashlib, json, sys
from pathlib import Path
store = Path(sys.argv[1])
for prefix in ("faiss-", ""):  # the main payload last: its line ends the output
    if not (store / f"{prefix}manifest.json").is_file():
        continue
    label = f"{prefix[:-1]}: " if prefix else ""
    stored = store / f"{prefix}parts"
    if not prefix and (store / "faiss-manifest.json").is_file() and not any(stored.glob("part-*")):
        print("receive: main payload not carried (the early archive only)")  # a FAISS-payload session
        continue
    manifest = json.loads((store / f"{prefix}manifest.json").read_text())
    missing = []
    for part in manifest["parts"]:
        path = store / f"{prefix}parts" / part["name"]
        ok = path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == part["sha256"]
        print(f"receive: {label}{part['name']} {'ok' if ok else 'MISSING' if not path.exists() else 'BAD HASH'}")
        if not ok:
            missing.append(part["name"])
    print(f"receive: {label}all parts here" if not missing else f"receive: {label}still missing {' '.join(missing)}")
PY

#!/usr/bin/env bash
# On the GPU machine, every call of the prepared run (docs/gpu-run.md): keep the part(s) this call carried under
# $MSN_GPU_STORE (/tmp/msn-gpu: outside the copied tree, so it outlives the call while the machine stays warm),
# check each stored part against the manifest, and say which are still missing. Idempotent.
set -euo pipefail
store=${MSN_GPU_STORE:-/tmp/msn-gpu}
mkdir -p "$store/parts"
shopt -s nullglob
for dir in .gpu/part-*/; do
  name=$(basename "$dir")
  cp "$dir/payload.part" "$store/parts/$name.tmp" && mv "$store/parts/$name.tmp" "$store/parts/$name"
  cp "$dir/manifest.json" "$store/manifest.json"
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
[ -f "$store/manifest.json" ] || { echo "receive: no manifest yet: carry a .gpu/part-NN folder"; exit 1; }
python3 - "$store" <<'PY'
import hashlib, json, sys
from pathlib import Path
store = Path(sys.argv[1])
manifest = json.loads((store / "manifest.json").read_text())
missing = []
for part in manifest["parts"]:
    path = store / "parts" / part["name"]
    ok = path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == part["sha256"]
    print(f"receive: {part['name']} {'ok' if ok else 'MISSING' if not path.exists() else 'BAD HASH'}")
    if not ok:
        missing.append(part["name"])
print("receive: all parts here" if not missing else f"receive: still missing {' '.join(missing)}")
PY

#!/usr/bin/env bash
# On the GPU machine, once every part is stored (receive.sh says "all parts here"): join the parts, check the
# payload's sha256 against the manifest, unpack it to $MSN_GPU_STORE/payload (site/ = the wheels, installed;
# official_msn/ = the official step code). Prints the PYTHONPATH to export. Idempotent: a checked payload is kept.
set -euo pipefail
store=${MSN_GPU_STORE:-/tmp/msn-gpu}
bash "$(dirname "$0")/receive.sh" | tail -1 | grep -q "all parts here" || { bash "$(dirname "$0")/receive.sh"; exit 1; }
if [ ! -f "$store/payload/.checked" ]; then
  python3 - "$store" <<'PY'
import hashlib, json, sys, tarfile
from pathlib import Path
store = Path(sys.argv[1])
manifest = json.loads((store / "manifest.json").read_text())
h, joined = hashlib.sha256(), store / "payload.tar.xz"
with joined.open("wb") as out:
    for part in manifest["parts"]:
        data = (store / "parts" / part["name"]).read_bytes()
        h.update(data)
        out.write(data)
if h.hexdigest() != manifest["payload_sha256"]:
    sys.exit(f"install: joined payload sha256 {h.hexdigest()} != manifest {manifest['payload_sha256']}")
with tarfile.open(joined) as tar:
    # the "data" filter refuses links and paths out of the store, where this Python has it (3.12, 3.11.4+)
    tar.extractall(store, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
joined.unlink()
(store / "payload" / ".checked").write_text(manifest["payload_sha256"] + "\n")
print(f"install: payload {manifest['payload_bytes'] / 2**20:.1f} MiB checked and unpacked; "
      f"{len(manifest['wheels'])} wheels")
PY
fi
echo "install: export PYTHONPATH=$store/payload/site:$store/early/site\${PYTHONPATH:+:\$PYTHONPATH}"

"""``python tests/serve/faulty_serve.py CONTROL -- <msn-serve arguments>``: msn-serve whose writes under its data
directory fail with the errno named in the file CONTROL (``ENOSPC``, ``EIO``) for as long as it names one.

The real server (uvicorn, the app, the stores) runs unchanged; only ``os.write``/``os.fsync`` are wrapped
(:mod:`faults`), which is where a full disk shows itself.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults import DiskFaults

if __name__ == "__main__":
    control, args = Path(sys.argv[1]), sys.argv[sys.argv.index("--") + 1:]
    data_dir = Path(args[args.index("--data-dir") + 1])
    data_dir.mkdir(parents=True, exist_ok=True)
    DiskFaults(data_dir, control=control).install()
    from msn_serve.cli import main

    raise SystemExit(main(args))

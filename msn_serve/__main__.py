"""``python -m msn_serve`` == ``msn-serve``."""
from msn_serve.cli import main

raise SystemExit(main())

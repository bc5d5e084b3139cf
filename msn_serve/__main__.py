"""``python -m msn_serve`` == ``msn-serve``."""
from .cli import main

raise SystemExit(main())

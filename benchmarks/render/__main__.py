"""``python -m benchmarks.render``: regenerate the tables of docs/ (see :mod:`benchmarks.render.docs`)."""
from benchmarks.render.docs import main

raise SystemExit(main())

"""Markdown and plots of docs/ rendered from the JSON the measuring scripts wrote; nothing here measures.

``python -m benchmarks.render`` (``docs.py``) is the one command that runs them."""

"""Markdown and plots of docs/ rendered from the JSON the measuring scripts wrote; nothing here measures.

``benchmarks/render_docs.py`` is the one command that runs them."""

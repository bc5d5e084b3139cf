"""The prepared GPU run: what a lent GPU machine (no network, 64 MiB per call) needs, and the run itself.

docs/gpu-run.md is the procedure; ``pack`` runs here, ``receive.sh`` / ``install.sh`` / ``run`` run there.
"""

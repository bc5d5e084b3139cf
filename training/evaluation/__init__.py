"""Label-efficient evaluation of exported MSN bundles (``msn-eval``).

``features`` embeds datasets (ONNX Runtime or torch, cached), ``splits`` holds the fixed low-shot subsets,
``lowshot`` is the paper's logistic-regression protocol, ``knn`` and ``linear_probe`` cover the many-label regime,
``robustness`` measures what masking changes, and ``cli`` ties them together.
"""

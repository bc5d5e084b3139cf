"""Scripts that measure and write JSON under ``benchmarks/results/``, grouped by what they measure: ``training/``,
``evaluation/``, ``serving/``; ``render/`` turns the JSON into the tables of ``docs/``. Run them from the repository
root as modules (``python -m benchmarks.serving.vits_bench``), so that they import the project like any other code.
"""

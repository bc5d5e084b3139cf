"""The code base stays lint-clean (ruff, configured in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it comes with the dev extra)")
    result = subprocess.run(
        [ruff, "check", "--output-format", "concise",
         "msn_core", "training", "msn_serve", "visualizer", "tests", "benchmarks"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr

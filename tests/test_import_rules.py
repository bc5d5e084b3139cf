"""The direction of imports (DESIGN.md), kept as tests.

The core imports neither torch nor any of the three packages, and only numpy besides the standard library (cyanure
inside the fit that needs it); ``msn_serve`` imports neither torch, ``training`` nor ``visualizer`` (its slim image
has no torch); ``training`` imports neither ``msn_serve`` nor ``visualizer``. Every import statement counts, also
the ones inside functions, so a lazy import cannot sneak past. A subprocess then imports the core with the
forbidden packages blocked, which also catches imports made through a dependency.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "msn_core": {"torch", "torchvision", "training", "msn_serve", "visualizer"},
    "msn_serve": {"torch", "torchvision", "training", "visualizer"},
    "training": {"msn_serve", "visualizer"},
}
CORE_THIRD_PARTY = {"numpy", "cyanure"}


def imported_roots(package: str) -> dict[str, set[str]]:
    """``{top-level module: {file:line, ...}}`` for every absolute import in the package's files."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package: str):
    roots = imported_roots(package)
    bad = {name: sorted(roots[name]) for name in FORBIDDEN[package] & set(roots)}
    assert not bad, f"{package} must not import {sorted(bad)}: {bad}"


def test_the_core_needs_only_numpy_and_the_standard_library():
    roots = imported_roots("msn_core")
    extra = set(roots) - set(sys.stdlib_module_names) - CORE_THIRD_PARTY - {"msn_core", "__future__"}
    assert not extra, {name: sorted(roots[name]) for name in extra}


def test_the_core_imports_and_works_with_torch_and_the_packages_blocked():
    code = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'torchvision', 'training', 'msn_serve', 'visualizer'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import msn_core
for m in pkgutil.iter_modules(msn_core.__path__):
    importlib.import_module('msn_core.' + m.name)
from msn_core.masks import resolve_mask
print(resolve_mask({"ratio": 0.7, "seed": 1}, 7).tolist())
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[3, 6, 9, 15, 16, 23, 24, 25, 27, 28, 30, 33, 37, 48]"

"""msn_core.optional: one registry of optional libraries and one error naming the install that fixes a missing one."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from msn_core.optional import (
    EXTRAS,
    GPU_INSTALL,
    MissingDependency,
    available,
    install_hint,
    missing,
    optional,
    require,
)

REPO = Path(__file__).resolve().parents[2]
# Where code may catch ImportError itself: the registry alone.
CATCHERS_ALLOWED = {"msn_core/optional.py"}
SKIPPED: tuple[str, ...] = ()


def _extras() -> dict[str, set[str]]:
    """``{extra: distributions it installs}``, with ``msn[other]`` entries expanded."""
    raw = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        out: set[str] = set()
        for requirement in raw[extra]:
            if m := re.fullmatch(r"msn\[([\w-]+)\]", requirement):
                out |= names(m[1])
            else:
                out.add(re.split(r"[<>=\[;~! ]", requirement, maxsplit=1)[0].lower())
        return out

    return {extra: names(extra) for extra in raw}


def test_every_extra_named_installs_the_library():
    extras = _extras()
    for module, (distribution, named) in EXTRAS.items():
        for extra in named:
            assert extra in extras, f"{module}: no extra {extra!r} in pyproject.toml"
            if distribution != "msn":  # the training package itself comes with any install of msn
                found = extras[extra] & {distribution, distribution.replace("-cpu", "-gpu-cuvs"),
                                         distribution.replace("onnxruntime", "onnxruntime-gpu")}
                assert found, f"{module}: msn[{extra}] does not install {distribution}"


def test_the_gpu_install_names_the_extras_that_swap_the_builds():
    """GPU_INSTALL (msn_core.optional, the one table of install hints) is pyproject's gpu extra instead of serve."""
    extras = _extras()
    gpu, cpu = re.findall(r"msn\[(\w+)\]", GPU_INSTALL)
    assert {"onnxruntime-gpu", "faiss-gpu-cuvs"} <= extras[gpu] and {"onnxruntime", "faiss-cpu"} <= extras[cpu]


def test_the_hint_names_the_extra_or_the_package():
    assert install_hint("faiss") == "pip install 'msn[serve]' (also part of msn[gpu])"
    assert install_hint("gradio.themes") == "pip install 'msn[viz]'"
    assert install_hint("pyarrow.parquet") == "pip install pyarrow"
    assert install_hint("somethingelse") == "pip install somethingelse"


def test_require_optional_available_and_missing():
    assert require("json", "anything").dumps([]) == "[]"
    assert optional("no_such_module_xyz") is None and optional("json") is not None
    assert available("json") and not available("no_such_module_xyz.sub")
    assert missing("json", "x") is None
    with pytest.raises(MissingDependency) as e:
        require("no_such_module_xyz", "the frobnicator")
    assert str(e.value) == "the frobnicator needs no_such_module_xyz, which is not installed: " \
                           "pip install no_such_module_xyz"
    assert isinstance(e.value, ImportError) and e.value.module == "no_such_module_xyz"


def test_a_blocked_library_is_missing_and_a_broken_one_says_so(tmp_path: Path):
    """In a fresh interpreter: gradio blocked as a slim install lacks it, and a package whose import fails."""
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("raise ImportError('libfoo.so: cannot open shared object')\n")
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'gradio':
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
from msn_core.optional import MissingDependency, require
for module in ('gradio', 'brokenpkg'):
    try:
        require(module, 'msn-visualize app')
    except MissingDependency as e:
        print(e)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                       check=True, env={"PYTHONPATH": f"{REPO}:{tmp_path}", "PATH": "/usr/bin:/bin"})
    assert r.stdout.splitlines() == [
        "msn-visualize app needs gradio, which is not installed: pip install 'msn[viz]'",
        ("msn-visualize app needs brokenpkg, which is installed but cannot be imported "
         "(libfoo.so: cannot open shared object)"),
    ]


def test_no_package_catches_import_errors_on_its_own():
    """Every optional import goes through msn_core.optional, so every missing library fails the same way."""
    bad = []
    for package in ("msn_core", "msn_serve", "training", "visualizer"):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in CATCHERS_ALLOWED or rel.startswith(SKIPPED):
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                caught = ast.unparse(node.type) if isinstance(node, ast.ExceptHandler) and node.type else ""
                if re.search(r"\b(ImportError|ModuleNotFoundError)\b", caught) or (
                        isinstance(node, ast.Attribute) and node.attr in ("find_spec", "import_module")):
                    bad.append(f"{rel}:{node.lineno}")
    assert not bad, f"use msn_core.optional (require / optional / available) instead: {bad}"

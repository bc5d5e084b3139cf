"""The direction of imports (docs/architecture.md), kept as tests.

Between packages: the core imports neither torch nor any of the packages, and only numpy besides the standard
library (cyanure inside the fit that needs it); ``msn_serve`` imports neither torch, ``training`` nor ``visualizer``
(its slim image has no torch); ``training`` imports neither ``msn_serve`` nor ``visualizer``; ``visualizer`` reaches
``training`` only through ``training.api``. Inside packages: no import cycle anywhere, and the sub-packages of
``training`` and ``msn_serve`` point one way (the rules below).

Every import statement counts, also the ones inside functions or under ``TYPE_CHECKING``, so a lazy import cannot
sneak past. Edges are between modules: a package stands for its ``__init__``, relative imports are resolved, and
``from pkg import name`` points at ``pkg.name`` when that is a submodule, else at ``pkg``. A subprocess then imports
the core with the forbidden packages blocked, which also catches imports made through a dependency.
"""
from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("msn_core", "training", "msn_serve", "visualizer", "benchmarks")
FORBIDDEN = {
    "msn_core": {"torch", "torchvision", "training", "msn_serve", "visualizer"},
    "msn_serve": {"torch", "torchvision", "training", "visualizer"},
    "training": {"msn_serve", "visualizer"},
}
CORE_THIRD_PARTY = {"numpy", "cyanure"}


# ---------------------------------------------------------------------------------------------------------------
# Between packages: top-level names
# ---------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------
# The module graph
# ---------------------------------------------------------------------------------------------------------------

Graph = dict[str, dict[str, list[str]]]  # {importer: {imported: ["file:line", ...]}}


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """``{dotted module name: file}``; a package's name maps to its ``__init__.py``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> Graph:
    modules = module_files(root, packages)

    def known(name: str) -> str | None:
        """The module an import of ``name`` loads last: itself, or its nearest package that is ours."""
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    def targets(name: str, path: Path):
        """(imported module, line) for every import statement of one module."""
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield known(alias.name), node.lineno
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    yield (submodule if submodule in modules else known(base)), node.lineno

    graph: Graph = {name: {} for name in modules}
    for name, path in modules.items():
        for target, line in targets(name, path):
            where = f"{path.relative_to(root)}:{line}"
            if target is not None and target != name and where not in graph[name].get(target, []):
                graph[name].setdefault(target, []).append(where)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the module count (hundreds)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)

    found = []
    for component in components:  # shortest way from the component's first module back to itself
        members, start = set(component), component[0]
        previous: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in previous:
            following = []
            for node in frontier:
                for succ in sorted(graph[node]):
                    if succ in members and succ not in previous:
                        previous[succ] = node
                        following.append(succ)
            frontier = following
        path, node = [start], previous[start]
        while node != start:
            path.append(node)
            node = previous[node]
        found.append([start, *reversed(path[1:]), start])
    return found


def describe(graph: Graph, cycle: list[str]) -> str:
    return "\n".join(f"  {a} -> {b}  ({', '.join(graph[a][b])})" for a, b in itertools.pairwise(cycle))


def inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(graph: Graph, importers, imported) -> list[str]:
    """Edges whose importer satisfies ``importers`` and whose target satisfies ``imported`` (both predicates)."""
    return [
        f"{a} -> {b}  ({', '.join(where)})"
        for a, targets in sorted(graph.items())
        if importers(a)
        for b, where in sorted(targets.items())
        if imported(b)
    ]


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(REPO)


# ---------------------------------------------------------------------------------------------------------------
# Rules over the graph
# ---------------------------------------------------------------------------------------------------------------


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n\n".join(describe(graph, c) for c in found)


# (importer sub-package, sub-packages it must not import)
TRAINING_DIRECTION = [
    ("training.model", ("training.run", "training.bundle", "training.evaluation")),
    ("training.evaluation", ("training.run", "training.bundle")),
    ("training.run", ("training.bundle", "training.evaluation")),
]


@pytest.mark.parametrize("importer,forbidden", TRAINING_DIRECTION, ids=[r[0] for r in TRAINING_DIRECTION])
def test_training_subpackages_point_one_way(graph, importer, forbidden):
    bad = violations(graph, lambda a: inside(a, importer), lambda b: any(inside(b, f) for f in forbidden))
    assert not bad, f"{importer} must not import {', '.join(forbidden)}:\n" + "\n".join(bad)


HTTP_ENTRY_POINTS = {"msn_serve.cli", "msn_serve.__main__"}


def test_only_the_entry_points_reach_msn_serve_http(graph):
    bad = violations(
        graph,
        lambda a: inside(a, "msn_serve") and not inside(a, "msn_serve.http") and a not in HTTP_ENTRY_POINTS,
        lambda b: inside(b, "msn_serve.http"),
    )
    assert not bad, "http validates and renders; services below it never import it:\n" + "\n".join(bad)


@pytest.mark.parametrize("room", ["msn_serve.embedding", "msn_serve.classifiers", "msn_serve.indexes"])
def test_serving_rooms_import_no_service_root_and_no_http(graph, room):
    bad = violations(
        graph,
        lambda a: inside(a, room),
        lambda b: inside(b, "msn_serve.service") or inside(b, "msn_serve.http"),
    )
    assert not bad, f"{room} must import neither msn_serve.service nor msn_serve.http:\n" + "\n".join(bad)


def test_visualizer_reaches_training_only_through_its_api(graph):
    bad = violations(
        graph, lambda a: inside(a, "visualizer"), lambda b: inside(b, "training") and b != "training.api"
    )
    assert not bad, "visualizer imports training only through training.api:\n" + "\n".join(bad)


# ---------------------------------------------------------------------------------------------------------------
# The graph and the rules on small packages of our own
# ---------------------------------------------------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_graph_resolves_relative_submodule_and_lazy_imports(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\nfrom .sub import thing\n",
        "pkg/b.py": "def f():\n    import pkg.sub.deep\n",
        "pkg/sub/__init__.py": "from .deep import x\nthing = 1\n",
        "pkg/sub/deep.py": "from .. import b\nimport numpy\n",
        "pkg/c.py": "from pkg import sub\nfrom pkg.sub import deep, thing\nimport pkg.missing\n",
    })
    graph = import_graph(tmp_path, ("pkg",))
    assert {a: set(b) for a, b in graph.items()} == {
        "pkg": set(),
        "pkg.a": {"pkg.b", "pkg.sub"},
        "pkg.b": {"pkg.sub.deep"},
        "pkg.sub": {"pkg.sub.deep"},
        "pkg.sub.deep": {"pkg.b"},
        "pkg.c": {"pkg.sub", "pkg.sub.deep", "pkg"},
    }
    assert graph["pkg.b"]["pkg.sub.deep"] == ["pkg/b.py:2"]
    assert cycles(graph) == [["pkg.b", "pkg.sub.deep", "pkg.b"]]


def test_cycle_across_packages_is_found_and_printed(tmp_path):
    _write(tmp_path, {
        "one/__init__.py": "",
        "one/x.py": "from two.y import f\n",
        "two/__init__.py": "from two import y\n",
        "two/y.py": "def f():\n    from one import x\n",
        "two/z.py": "import one.x\n",
    })
    graph = import_graph(tmp_path, ("one", "two"))
    (cycle,) = cycles(graph)
    assert cycle == ["one.x", "two.y", "one.x"]
    assert describe(graph, cycle) == "  one.x -> two.y  (one/x.py:1)\n  two.y -> one.x  (two/y.py:2)"
    _write(tmp_path, {"two/y.py": "def f():\n    pass\n"})
    assert cycles(import_graph(tmp_path, ("one", "two"))) == []


def test_direction_rules_catch_what_they_should(tmp_path):
    _write(tmp_path, {
        "training/__init__.py": "",
        "training/api.py": "from training.model import vit\n",
        "training/model/__init__.py": "",
        "training/model/vit.py": "def f():\n    from ..run import step\n",
        "training/run/__init__.py": "",
        "training/run/step.py": "from training.model.vit import f\n",
        "visualizer/__init__.py": "",
        "visualizer/app.py": "from training import api\nfrom training.api import x\n",
        "visualizer/bad.py": "import training.model.vit\n",
        "msn_serve/__init__.py": "",
        "msn_serve/cli.py": "from msn_serve.http import app\n",
        "msn_serve/runtime.py": "from .http.app import build\n",
        "msn_serve/http/__init__.py": "",
        "msn_serve/http/app.py": "from msn_serve.indexes import store\n",
        "msn_serve/indexes/__init__.py": "",
        "msn_serve/indexes/store.py": "from msn_serve import service\n",
        "msn_serve/service.py": "",
    })
    graph = import_graph(tmp_path, ("training", "visualizer", "msn_serve"))
    model_rule = violations(graph, lambda a: inside(a, "training.model"), lambda b: inside(b, "training.run"))
    assert model_rule == ["training.model.vit -> training.run.step  (training/model/vit.py:2)"]
    assert violations(graph, lambda a: inside(a, "training.run"), lambda b: inside(b, "training.model")) != []
    assert violations(
        graph, lambda a: inside(a, "visualizer"), lambda b: inside(b, "training") and b != "training.api"
    ) == ["visualizer.bad -> training.model.vit  (visualizer/bad.py:1)"]
    http = violations(
        graph,
        lambda a: inside(a, "msn_serve") and not inside(a, "msn_serve.http") and a not in HTTP_ENTRY_POINTS,
        lambda b: inside(b, "msn_serve.http"),
    )
    assert http == ["msn_serve.runtime -> msn_serve.http.app  (msn_serve/runtime.py:1)"]
    assert violations(
        graph, lambda a: inside(a, "msn_serve.indexes"), lambda b: inside(b, "msn_serve.service")
    ) == ["msn_serve.indexes.store -> msn_serve.service  (msn_serve/indexes/store.py:1)"]
    assert cycles(graph) == [["training.model.vit", "training.run.step", "training.model.vit"]]

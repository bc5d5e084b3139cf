"""The direction of imports (docs/architecture.md), kept as tests.

Between packages: the core imports neither torch nor any of the packages, and only numpy besides the standard
library (cyanure inside the fit that needs it); ``msn_serve`` imports neither torch, ``training`` nor ``visualizer``
(its slim image has no torch); ``training`` imports neither ``msn_serve`` nor ``visualizer``; ``visualizer`` reaches
``training`` only through ``training.api``. Inside packages: no import cycle anywhere, the sub-packages of
``training`` point one way, and the units of ``msn_serve`` keep their rows (the rules below). docs/architecture.md
draws the same graph (``tests/import_graph.py`` builds it for both), and a test here fails when its picture is stale.

Every import statement counts, also the ones inside functions or under ``TYPE_CHECKING``, so a lazy import cannot
sneak past (the graph's rules are in ``tests/import_graph.py``). A subprocess then imports the core with the
forbidden packages blocked, which also catches imports made through a dependency.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_graph import (
    BEGIN,
    COMMAND,
    DOC,
    END,
    REPO,
    Graph,
    cycles,
    describe,
    import_graph,
    inside,
    picture,
    rows,
    unit_graph,
    violations,
    with_picture,
)

FORBIDDEN = {
    "msn_core": {"torch", "torchvision", "training", "msn_serve", "visualizer"},
    "msn_serve": {"torch", "torchvision", "training", "visualizer"},
    "training": {"msn_serve", "visualizer"},
}
# numpy at the top of a module; the others only inside the functions that need them (the low-shot fit, running a
# graph, an image), so ``import msn_core`` stays numpy + the standard library.
CORE_THIRD_PARTY = {"numpy", "cyanure", "onnxruntime", "openvino", "PIL"}
CORE_TOP_LEVEL = {"numpy"}


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


def module_level_imports(tree: ast.Module):
    """``(line, name)`` of every absolute import that runs when the module is imported: not inside a function, nor
    under ``if TYPE_CHECKING``."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        stack.extend(ast.iter_child_nodes(node))


def test_the_core_imports_its_optional_libraries_only_inside_functions():
    """A module-level import of anything but numpy would make ``import msn_core`` need it."""
    allowed = set(sys.stdlib_module_names) | CORE_TOP_LEVEL | {"msn_core", "__future__"}
    bad = [
        f"{path.relative_to(REPO)}:{line} {name}"
        for path in sorted((REPO / "msn_core").rglob("*.py"))
        for line, name in module_level_imports(ast.parse(path.read_text(), str(path)))
        if name.split(".")[0] not in allowed
    ]
    assert not bad, bad


def test_module_level_imports_skip_functions_and_type_checking():
    tree = ast.parse("import numpy\nif TYPE_CHECKING:\n    import PIL\nelse:\n    import json\n"
                     "def f():\n    import openvino\nclass C:\n    import zlib\n    def g(self):\n        import onnx\n"
                     "try:\n    import cyanure\nexcept ImportError:\n    pass\n")
    assert sorted(name for _, name in module_level_imports(tree)) == ["cyanure", "json", "numpy", "zlib"]


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
        lambda a: (inside(a, "msn_serve") and not inside(a, "msn_serve.http") and a not in HTTP_ENTRY_POINTS
                   and not inside(a, "msn_serve.workers")),  # the HTTP processes run http's parsing and rendering
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


# msn_serve's units, top row first: a unit imports only units on rows below its own; the shared root modules of the
# bottom row may import each other (the cycle test keeps that one way). A unit missing here fails the test below: a
# new module or sub-package of msn_serve takes its place here and in docs/architecture.md's prose.
MSN_SERVE_ROWS = [
    ("client",),  # the Python client: HTTP only, imports nothing else of msn_serve, and nothing imports it
    ("__main__",),
    ("cli", "doctor"),  # msn-serve; msn-doctor (what this machine offers, torch only in a subprocess)
    ("workers",),  # HTTP worker processes around the engine process: the /embed stages, the rest forwarded
    ("http",),  # validates requests, calls the services with plain arguments, renders the results
    ("runtime",),  # builds the services from the settings and the bundle, starts and stops them
    ("snapshots",),  # read-only replicas reload what the one writer published
    ("publish",),  # the writer publishes classifiers and indexes
    ("corpus",),  # msn-embed: a corpus through the engine into shards (and an index), offline
    # few-shot classifiers and the label loop, over the indexes' vectors; msn-index, the offline tools above the live
    # store they fill (build, migrate, the Milvus copies). One row, so neither imports the other.
    ("classifiers", "index_tools"),
    ("indexes",),  # named FAISS indexes, filled from embeddings
    ("embedding",),  # images in, embeddings out
    ("device",),  # cpu / cuda (refused when it cannot work) / auto, decided before anything loads
    ("__init__", "config", "errors", "jsontext", "masks", "metrics", "work"),
]


def row_violations(units: Graph, package: str, declared: list[tuple[str, ...]]) -> tuple[list[str], list[str]]:
    """(units on no declared row, edges that do not point to a lower row) of one package's unit graph."""
    row = {package if name == "__init__" else f"{package}.{name}": i for i, names in enumerate(declared)
           for name in names}
    unplaced = sorted(set(units) - set(row))
    bottom = len(declared) - 1
    upward = [
        f"{a} -> {b}  ({', '.join(where)})"
        for a, targets in sorted(units.items())
        for b, where in sorted(targets.items())
        if a in row and b in row and not (row[b] > row[a] or row[a] == row[b] == bottom)
    ]
    return unplaced, upward


def test_msn_serve_units_keep_their_rows(graph):
    unplaced, upward = row_violations(unit_graph(graph, "msn_serve"), "msn_serve", MSN_SERVE_ROWS)
    assert not unplaced, f"put {unplaced} on a row of MSN_SERVE_ROWS (tests/test_import_rules.py)"
    order = " > ".join("/".join(names) for names in MSN_SERVE_ROWS)
    assert not upward, f"msn_serve imports point down its rows ({order}):\n" + "\n".join(upward)


def test_the_architecture_page_draws_this_graph(graph):
    page = DOC.read_text()
    assert with_picture(page, picture(graph)) == page, (
        f"{DOC.relative_to(REPO)}: the picture is not the code's import graph; redraw it with `{COMMAND}`")


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
        lambda a: (inside(a, "msn_serve") and not inside(a, "msn_serve.http") and a not in HTTP_ENTRY_POINTS
                   and not inside(a, "msn_serve.workers")),  # the HTTP processes run http's parsing and rendering
        lambda b: inside(b, "msn_serve.http"),
    )
    assert http == ["msn_serve.runtime -> msn_serve.http.app  (msn_serve/runtime.py:1)"]
    assert violations(
        graph, lambda a: inside(a, "msn_serve.indexes"), lambda b: inside(b, "msn_serve.service")
    ) == ["msn_serve.indexes.store -> msn_serve.service  (msn_serve/indexes/store.py:1)"]
    assert cycles(graph) == [["training.model.vit", "training.run.step", "training.model.vit"]]


def test_rows_rule_catches_an_upward_edge_and_a_unit_without_a_row(tmp_path):
    _write(tmp_path, {
        "srv/__init__.py": "",
        "srv/errors.py": "",
        "srv/config.py": "from srv.errors import E\n",
        "srv/low/__init__.py": "",
        "srv/low/a.py": "from srv import config\n",
        "srv/high/__init__.py": "",
        "srv/high/b.py": "from srv.low import a\n",
        "srv/new.py": "",
    })
    declared = [("high",), ("low",), ("__init__", "config", "errors")]
    units = unit_graph(import_graph(tmp_path, ("srv",)), "srv")
    assert row_violations(units, "srv", declared) == (["srv.new"], [])
    _write(tmp_path, {"srv/low/a.py": "def f():\n    from srv.high import b\n"})
    units = unit_graph(import_graph(tmp_path, ("srv",)), "srv")
    assert row_violations(units, "srv", declared)[1] == ["srv.low -> srv.high  (srv/low/a.py:2)"]
    assert row_violations(units, "srv", [("low",), ("high",), ("__init__", "config", "errors")])[1] == [
        "srv.high -> srv.low  (srv/high/b.py:1)"]


def test_rows_put_each_node_above_what_it_imports_and_cycles_on_one_row():
    assert rows({"a": ["b"], "b": ["c"], "c": [], "d": ["c"]}) == [[["c"]], [["b"], ["d"]], [["a"]]]
    assert rows({"top": ["x"], "x": ["y"], "y": ["x", "z"], "z": []}) == [[["z"]], [["x", "y"]], [["top"]]]


def test_picture_draws_every_module_in_rows_and_replaces_only_the_marked_block(tmp_path):
    _write(tmp_path, {
        "core/__init__.py": "",
        "core/masks.py": "",
        "app/__init__.py": "",
        "app/cli.py": "from app.http import routes\n",
        "app/http/__init__.py": "",
        "app/http/routes.py": "from app.engine import run\nfrom core import masks\n",
        "app/http/schemas.py": "",
        "app/engine/__init__.py": "",
        "app/engine/run.py": "from app import errors\nfrom core.masks import keep\n",
        "app/errors.py": "",
    })
    drawing = picture(import_graph(tmp_path, ("core", "app")), ("core", "app"))
    assert drawing == """\
Packages (a row imports only rows below it; → the packages it imports, and which of their units):
  1  app/  → core (masks)
  0  core/

app/ (→ the units of app it imports):
  3  cli.py   → http/
  2  http/    routes.py  schemas.py
              → engine/
  1  engine/  run.py
              → errors.py
  0  __init__.py  errors.py

core/ (→ the units of core it imports):
  0  __init__.py  masks.py
"""
    page = f"# Title\n\nprose\n\nbefore\n{BEGIN}\nold\n{END}\nafter\n"
    assert with_picture(page, drawing) == f"# Title\n\nprose\n\nbefore\n{BEGIN}\n```text\n{drawing}```\n{END}\nafter\n"
    with pytest.raises(ValueError, match="markers"):
        with_picture("no markers\n", drawing)

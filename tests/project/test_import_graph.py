"""The layers of tsp_core and the adapters, read from the source with ``ast``: no import cycle
between modules or between packages, and every import between packages points down the one
order written here (docs/design.md "Code map").

Imports inside functions count (a lazy import that dodges a cycle is still a cycle); only
imports under ``if TYPE_CHECKING:`` are left out, since they never run."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top: a package may import only the packages before it. "tsp_core" is the public face
# (tsp_core/__init__.py); the adapters sit on top of everything. tsp_trl builds on
# tsp_transformers (TRL's trainers are Trainers); nothing imports it, so it sits on top.
ORDER = ("tsp_core.distributed", "tsp_core.sequence", "tsp_core.layers", "tsp_core.inference",
         "tsp_core.state", "tsp_core.models", "tsp_core.pipeline",
         "tsp_core.baselines", "tsp_core.plan", "tsp_core",
         "tsp_core.tools", "tsp_deepspeed", "tsp_accelerate", "tsp_transformers", "tsp_lightning",
         "tsp_trl")

SOURCES = {"tsp_core": ROOT / "tsp_core", **{name: ROOT / "integrations" / name
                                              for name in ORDER if not name.startswith("tsp_core")}}


def modules(sources: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's ``__init__``), for every top-level package."""
    found = {}
    for top, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            is_init = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                continue
            stack.append(child)


def import_graph(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the modules of ``mods`` it imports (``from pkg import name`` is an edge to the
    module ``pkg.name`` when there is one, else to ``pkg``)."""
    graph: dict[str, set[str]] = {}
    for name, (path, is_init) in mods.items():
        edges = graph.setdefault(name, set())
        package = name.split(".") if is_init else name.split(".")[:-1]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = package[:len(package) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source
                           for a in node.names]
            for target in targets:
                while target and target not in mods:  # import a.b.c: the deepest module we have
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_of(module: str, order: tuple[str, ...] = ORDER) -> str | None:
    """The longest entry of ``order`` that is ``module`` or holds it."""
    best = None
    for package in order:
        if module == package or module.startswith(package + "."):
            if best is None or len(package) > len(best):
                best = package
    return best


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for source, targets in graph.items():
        a = package_of(source)
        packages.setdefault(a, set()).update(b for b in map(package_of, targets) if b != a)
    return packages


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {p: i for i, p in enumerate(ORDER)}
    return [f"{source} ({package_of(source)}) imports {target} ({package_of(target)})"
            for source, targets in sorted(graph.items()) for target in sorted(targets)
            if rank[package_of(target)] > rank[package_of(source)]]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(modules(SOURCES))


def test_every_module_sits_in_a_package_of_the_order(graph):
    # the root holds only the public face; a new package must take its place in ORDER
    stray = [m for m in graph if package_of(m) is None
             or (package_of(m) == "tsp_core" and m != "tsp_core")]
    assert not stray, f"modules outside the packages of ORDER: {stray}"


def test_no_cycle_between_modules(graph):
    assert not cycles(graph), f"import cycles between modules: {cycles(graph)}"


def test_no_cycle_between_packages(graph):
    found = cycles(package_graph(graph))
    assert not found, f"import cycles between packages: {found}"


def test_imports_point_down_the_order(graph):
    up = upward_imports(graph)
    assert not up, "imports against the order of packages:\n" + "\n".join(up)


def test_the_graph_sees_what_would_break_it(tmp_path):
    """The checks fail on a planted lazy cycle and a planted upward import, and leave
    ``if TYPE_CHECKING:`` imports out."""
    pkg = tmp_path / "tsp_core"
    for sub, text in {
        "__init__.py": "",
        "distributed/__init__.py": "",
        "distributed/comm.py": "from ..models import parallelize\n",          # upward
        "models/__init__.py": "",
        "models/parallelize.py": ("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from ..layers import mlp\n"),
        "layers/__init__.py": "",
        "layers/mlp.py": "def f():\n    from . import moe\n",                 # lazy cycle
        "layers/moe.py": "from .mlp import f\n",
    }.items():
        (pkg / sub).parent.mkdir(parents=True, exist_ok=True)
        (pkg / sub).write_text(text)
    g = import_graph(modules({"tsp_core": pkg}))
    assert cycles(g) == [["tsp_core.layers.mlp", "tsp_core.layers.moe"]]
    assert "tsp_core.layers.mlp" not in g["tsp_core.models.parallelize"]
    assert upward_imports(g) == ["tsp_core.distributed.comm (tsp_core.distributed) imports "
                                 "tsp_core.models.parallelize (tsp_core.models)"]
    g["tsp_core.models.parallelize"].add("tsp_core.distributed.comm")
    assert cycles(package_graph(g)) == [["tsp_core.distributed", "tsp_core.models"]]


def test_integrations_are_their_own_packages():
    for name, folder in SOURCES.items():
        assert (folder / "__init__.py").is_file(), f"{name}: no package at {os.fspath(folder)}"


def test_every_integration_takes_its_place_in_the_order():
    # the graph reads only the packages of ORDER: a new adapter left out would go unchecked
    found = sorted(p.parent.name for p in (ROOT / "integrations").glob("*/__init__.py"))
    missing = [name for name in found if name not in ORDER]
    assert not missing, f"integrations/ packages missing from ORDER: {missing}"

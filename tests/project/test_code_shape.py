"""The shape of the code, read from the source with ``ast``: short functions, a ``parallelize``
that reads as its list of stages, an attention built from parts rather than flags, a policy of
small groups, and no private name of tsp_core or an adapter used outside its module. Each
limit is the one the project keeps (docs/design.md "Code map"); a change that breaks one has
grown a flag or a body that should be a part or a function."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "tsp_core", ROOT / "integrations"]


def functions(root: Path):
    """(path, qualified name, node) of every function under ``root``."""
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        stack: list[tuple[ast.AST, str]] = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        yield path, name, child
                    stack.append((child, name + "."))
                else:
                    stack.append((child, prefix))


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_function_in_tsp_core_is_longer_than_120_lines():
    long = [f"{p.relative_to(ROOT)}:{n} ({lines(f)} lines)"
            for p, n, f in functions(ROOT / "tsp_core") if lines(f) > 120]
    assert not long, long


def test_parallelize_reads_as_its_stages():
    (node,) = [f for p, n, f in functions(ROOT / "tsp_core" / "models")
               if n == "parallelize" and p.name == "parallelize.py"]
    assert lines(node) <= 80, lines(node)


def test_attention_takes_parts_not_flags():
    import inspect

    from tsp_core.layers.attention import TSPAttention

    params = [n for n in inspect.signature(TSPAttention.__init__).parameters if n != "self"]
    assert len(params) <= 12, params


def test_decoder_policy_is_small_groups():
    from tsp_core.models.policies import DecoderPolicy

    fields = [f.name for f in dataclasses.fields(DecoderPolicy)]
    assert len(fields) <= 16, fields


def private_names_defined(root: Path) -> dict[str, set[str]]:
    """Module name -> the underscore names it defines at its top level."""
    out: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        module = module.removeprefix("integrations.").removesuffix(".__init__")
        tree = ast.parse(path.read_text(), str(path))
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        out[module] = {n for n in names if n.startswith("_") and not n.startswith("__")}
    return out


def test_no_private_name_crosses_a_module():
    """A name another module imports is part of its module's interface: it has a public name
    (the shared attention machinery, the MLP's activations, the layouts' keys, ...)."""
    private = {m: n for root in SOURCES for m, n in private_names_defined(root).items()}
    crossing = []
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            package = ".".join(path.relative_to(ROOT).parts[:-1])
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = package.split(".")
                if node.level:
                    base = base[:len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                module = module.removeprefix("integrations.")
                for alias in node.names:
                    if alias.name in private.get(module, ()):
                        crossing.append(f"{path.relative_to(ROOT)}: {module}.{alias.name}")
    assert not crossing, crossing

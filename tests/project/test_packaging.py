"""The extras of pyproject.toml install what the code imports. Read from the source with ``ast``
(imports inside functions count, those under ``if TYPE_CHECKING:`` do not): every third-party
module each adapter reaches, through its own modules and the project modules they import, and every
one tsp_core's modules import, is torch (the one base dependency) or a requirement named in that
package's extra. ``parallelize`` imports transformers, so every adapter's extra names it.

A few imports serve one optional feature and are reached only inside functions (``import
tsp_lightning`` works without them); OPTIONAL names each with the extra that provides it, and the
test checks that they are indeed reached only lazily. ``[all]`` and ``[dev]`` cover every extra."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.project.test_import_graph import ROOT, SOURCES, _is_type_checking, modules

PROJECT = canonicalize_name("tsp-parallel")
BASE = "torch"
# package -> the extra that must install what it imports
EXTRA = {"tsp_core": "transformers", "tsp_deepspeed": "deepspeed", "tsp_accelerate": "accelerate",
         "tsp_transformers": "transformers", "tsp_lightning": "lightning", "tsp_trl": "trl"}
# package -> {distribution: (the extra that provides it, the feature that needs it)}
DEEPSPEED = ("deepspeed", "DeepSpeed through this adapter")
PEFT = ("peft", "parallelize of a PEFT PeftModel (LoRA)")  # every package reaches parallelize
QLORA = ("qlora", "parallelize of a PeftModel over a 4-bit NF4 base (QLoRA)")
LORA = {"peft": PEFT, "bitsandbytes": QLORA}
OPTIONAL = {"tsp_core": {"matplotlib": ("bench", "tsp bench --plot"), **LORA},
            "tsp_accelerate": {"deepspeed": DEEPSPEED, **LORA},
            "tsp_transformers": {"deepspeed": DEEPSPEED, **LORA},
            "tsp_lightning": {"deepspeed": ("deepspeed", 'Trainer(strategy="tsp_deepspeed")'),
                              **LORA},
            "tsp_trl": {"deepspeed": DEEPSPEED, **LORA},
            "tsp_deepspeed": LORA}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def imports_with_depth(tree: ast.AST):
    """(Import / ImportFrom node, whether it sits inside a function), except under TYPE_CHECKING."""
    stack = [(tree, False)]
    while stack:
        node, lazy = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                continue
            stack.append((child, inner))


def edges(name: str, path, is_init: bool, mods: dict) -> list[tuple[str, bool, bool]]:
    """What module ``name`` imports: (project module or top-level third-party name, is it a
    project module, is the import inside a function). Importing ``a.b.c`` runs ``a`` and ``a.b``
    too."""
    package = name.split(".") if is_init else name.split(".")[:-1]
    found = []
    for node, lazy in imports_with_depth(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = package[:len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            targets = [source] + [f"{source}.{a.name}" for a in node.names
                                  if f"{source}.{a.name}" in mods]
        for target in targets:
            parts = target.split(".")
            if parts[0] not in SOURCES:
                found.append((parts[0], False, lazy))
                continue
            for i in range(1, len(parts) + 1):  # the packages above run first
                if ".".join(parts[:i]) in mods:
                    found.append((".".join(parts[:i]), True, lazy))
    return found


def reached(package: str, roots: tuple[str, ...] = ()) -> dict[str, tuple[bool, str]]:
    """Every third-party distribution the modules of ``package`` (or only ``roots``) reach ->
    (reached only inside functions, the module that imports it). Project modules are followed; a
    module reached inside a function makes everything it imports lazy too."""
    mods = modules(SOURCES)
    names = importlib.metadata.packages_distributions()
    best: dict[str, bool] = {m: False for m in roots or mods if m.split(".")[0] == package}
    work = list(best)
    found: dict[str, tuple[bool, str]] = {}
    while work:
        module = work.pop()
        path, is_init = mods[module]
        for target, ours, lazy in edges(module, path, is_init, mods):
            lazy = lazy or best[module]
            if ours:
                if target not in best or (best[target] and not lazy):
                    best[target] = lazy
                    work.append(target)
                continue
            if target in sys.stdlib_module_names or target == "__future__":
                continue
            dist = canonicalize_name(names.get(target, [target])[0])
            if dist not in found or (found[dist][0] and not lazy):
                found[dist] = (lazy, module)
    return found


def requirement_names(table: dict[str, list[str]], extra: str) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, table[extra])}


def uncovered(table: dict[str, list[str]], dependencies: list[str]) -> list[str]:
    """What the extras in ``table`` (pyproject's [project.optional-dependencies]) fail to install,
    one line each, naming the module, the distribution and the extra to add it to."""
    base = {canonicalize_name(Requirement(r).name) for r in dependencies}
    assert base == {BASE}, dependencies
    problems = []
    for package, extra in EXTRA.items():
        wanted = requirement_names(table, extra)
        optional = OPTIONAL.get(package, {})
        for dist, (lazy, module) in sorted(reached(package).items()):
            if dist in (PROJECT, BASE):
                continue
            if dist in optional:
                other, feature = optional[dist]
                if not lazy:
                    problems.append(f"{module} imports {dist} at import time, but {package} "
                                    f"leaves it to the [{other}] extra ({feature} only)")
                if dist not in requirement_names(table, other):
                    problems.append(f"{module} imports {dist} ({feature}): add it to the "
                                    f"[{other}] extra")
            elif dist not in wanted:
                problems.append(f"{module} imports {dist}: add it to the [{extra}] extra "
                                f"({package})")
    return problems


def test_every_extra_installs_what_its_package_imports():
    project = pyproject()["project"]
    problems = uncovered(project["optional-dependencies"], project["dependencies"])
    assert not problems, "\n".join(problems)


def test_a_missing_requirement_is_named():
    # the check above can fail: without accelerate in [transformers] (tsp_transformers imports
    # it) and transformers in [lightning] (parallelize imports it), it names both
    project = pyproject()["project"]
    table = {k: list(v) for k, v in project["optional-dependencies"].items()}
    table["transformers"] = [r for r in table["transformers"] if not r.startswith("accelerate")]
    table["lightning"] = [r for r in table["lightning"] if not r.startswith("transformers")]
    problems = "\n".join(uncovered(table, project["dependencies"]))
    assert "imports accelerate: add it to the [transformers] extra (tsp_transformers)" in problems
    assert "imports transformers: add it to the [lightning] extra (tsp_lightning)" in problems
    assert "[trl]" not in problems, problems


def test_bench_installs_what_tsp_bench_imports():
    # `tsp bench` (--plot too) needs only the [bench] extra
    table = pyproject()["project"]["optional-dependencies"]
    wanted = set(requirement_names(table, "bench")) | {BASE, PROJECT}
    found = reached("tsp_core", ("tsp_core.tools.cli", "tsp_core.tools.bench",
                                 "tsp_core.tools.bench_generate"))
    assert "matplotlib" in found, found
    # peft and bitsandbytes are reached only inside parallelize's PeftModel branch and the NF4
    # shards' dequantization (OPTIONAL): bench converts no PeftModel
    missing = {d: m for d, (lazy, m) in found.items()
               if d not in wanted and not (lazy and OPTIONAL["tsp_core"].get(d) in (PEFT, QLORA))}
    assert not missing, f"add to the [bench] extra: {missing}"


def test_all_and_dev_cover_every_extra():
    table = pyproject()["project"]["optional-dependencies"]
    extras = set(table) - {"all"}
    (whole,) = map(Requirement, table["all"])
    assert canonicalize_name(whole.name) == PROJECT and whole.extras == extras, (whole, extras)
    dev = requirement_names(table, "dev")
    for extra in extras - {"dev"}:
        for dist, requirement in requirement_names(table, extra).items():
            assert dist in dev, f"[dev] lacks {requirement} (from [{extra}])"
            assert dev[dist].specifier == requirement.specifier, (
                f"[dev] pins {dev[dist]}, [{extra}] {requirement}")


def test_optional_imports_are_not_needed_to_import():
    # what OPTIONAL leaves to another extra is really not imported by `import <package>`: import
    # each package with those distributions absent (None in sys.modules: an import raises
    # ModuleNotFoundError and find_spec answers None, as when it is not installed); one process
    # per set of absent distributions, since Lightning imports matplotlib itself
    groups: dict[tuple[str, ...], list[str]] = {}
    for package, optional in OPTIONAL.items():
        module = "tsp_core.tools.bench" if package == "tsp_core" else package
        groups.setdefault(tuple(sorted(optional)), []).append(module)
    for hidden, packages in groups.items():
        code = (
            "import sys\n"
            f"HIDDEN = {list(hidden)!r}\n"
            "sys.modules.update(dict.fromkeys(HIDDEN))\n"
            f"import {', '.join(packages)}\n"
            "print(sorted({m.split('.')[0] for m, v in sys.modules.items() if v is not None}\n"
            "             & set(HIDDEN)))\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        assert proc.returncode == 0 and proc.stdout == "[]\n", (packages, proc.stderr[-3000:])

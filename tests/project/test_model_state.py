"""One typed state object per converted model (``tsp_core.distributed.model_state``), not
attributes hung on it: the source holds at most three ``_tsp_*`` attribute names (the model's
``_tsp_state``, a parameter's ``_tsp_dp_hooked``, the context-parallel baseline's ``_tsp_cp``),
and no adapter sets a ``_tsp_*`` attribute on anything (they use the state's documented fields)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from torch import nn

from tsp_core.distributed.model_state import (
    TSPModelState,
    attach_model_state,
    find_model_state,
    model_state,
)

ROOT = Path(__file__).resolve().parents[2]
MOST_NAMES = 3
# an attribute read or written (``x._tsp_name``) or named by a string (``getattr(x, "_tsp_name")``)
ATTRIBUTE = re.compile(r"""\._tsp_[a-z_]+|["']_tsp_[a-z_]+["']""")


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def attribute_names() -> dict[str, list[str]]:
    """Each ``_tsp_*`` attribute name in tsp_core and the adapters -> the files naming it."""
    found: dict[str, list[str]] = {}
    for path in sources("tsp_core", "integrations"):
        for match in ATTRIBUTE.findall(path.read_text(encoding="utf-8")):
            name = match.strip(".\"'")
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def tsp_attribute_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every ``_tsp_*`` attribute the code sets: an assignment to
    ``x._tsp_name``, ``setattr``/``object.__setattr__`` with such a name, or a class attribute
    of that name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and node.attr.startswith("_tsp_"):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            arg = node.args[1]
            if name in ("setattr", "__setattr__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str) and arg.value.startswith("_tsp_"):
                out.append((node.lineno, arg.value))
        elif isinstance(node, ast.ClassDef):
            for statement in node.body:
                targets = (statement.targets if isinstance(statement, ast.Assign)
                           else [statement.target] if isinstance(statement, ast.AnnAssign)
                           else [])
                out.extend((statement.lineno, t.id) for t in targets
                           if isinstance(t, ast.Name) and t.id.startswith("_tsp_"))
    return out


def test_at_most_three_tsp_attribute_names():
    found = attribute_names()
    assert len(found) <= MOST_NAMES, (
        f"{len(found)} distinct _tsp_* attribute names in tsp_core and integrations (at most "
        f"{MOST_NAMES}): " + "; ".join(f"{n} in {sorted(set(f))}" for n, f in sorted(found.items()))
        + ". Keep what tsp_core knows about a model in its TSPModelState (model_state(model)); "
          "an adapter's own attributes need no _tsp_ prefix")


def test_no_adapter_sets_a_tsp_attribute():
    writes = [f"{path.relative_to(ROOT)}:{line}: {name}"
              for path in sources("integrations")
              for line, name in tsp_attribute_writes(ast.parse(path.read_text(encoding="utf-8")))]
    assert not writes, ("an adapter sets _tsp_* attributes (set the model's TSPModelState's "
                        "documented fields, model_state(model).<field>, and give the adapter's "
                        "own attributes plain private names): " + "; ".join(writes))


def test_the_write_finder_sees_each_kind_of_write():
    code = ("x._tsp_a = 1\nsetattr(x, '_tsp_b', 1)\nobject.__setattr__(x, '_tsp_c', 1)\n"
            "class K:\n    _tsp_d = 1\n    _tsp_e: int = 1\ny = x._tsp_f\n")
    assert sorted(tsp_attribute_writes(ast.parse(code))) \
        == [(1, "_tsp_a"), (2, "_tsp_b"), (3, "_tsp_c"), (5, "_tsp_d"), (6, "_tsp_e")]


def test_model_state_of_a_model_that_was_not_converted():
    plain = nn.Linear(2, 2)
    assert find_model_state(plain) is None
    assert find_model_state(object()) is None
    with pytest.raises(ValueError, match="Linear was not parallelized with tsp_core.parallelize"):
        model_state(plain)


def test_a_model_gets_its_state_once():
    model = nn.Linear(2, 2)
    state = attach_model_state(model, TSPModelState(None, None, nn.Linear))
    assert model_state(model) is state and find_model_state(model) is state
    assert "_tsp_state" not in dict(model.named_children())  # not a submodule, not in state_dict
    assert state.long_context() == {"tile_tokens": None, "activation_offload": False}
    with pytest.raises(ValueError, match="Linear already has a TSP state: it is converted"):
        attach_model_state(model, TSPModelState(None, None, nn.Linear))

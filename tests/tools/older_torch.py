"""A Python process that sees torch 2.11's API: a ``sitecustomize`` (run at every interpreter
start, before any test code) removes the symbols that torch 2.11 lacks and tsp_core knows of, so
tests on this torch can check what the GPU image (torch 2.11) does: ``import tsp_core`` works,
``./run gpu-check`` passes, and features that need a newer torch refuse by name
(docs/gpu.md "Torch versions"). The folder goes first on PYTHONPATH, which child processes
inherit: gpu-check's worker processes see the same torch."""

from __future__ import annotations

import json
import os
from pathlib import Path

# module -> names that module has from torch 2.12 on (and torch 2.11 lacks)
NEWER_THAN_2_11: dict[str, tuple[str, ...]] = {
    "torch.distributed": ("all_gather_single", "reduce_scatter_single"),
    "torch.distributed.fsdp._fully_shard._fsdp_api": ("DataParallelMeshDims",),
}

SITECUSTOMIZE = '''"""Written by tests/tools/older_torch.py: hide what torch 2.11 lacks, then log
which of those names this process lacks (one line per process) to the file LOG."""
import importlib, json, os

_absent = []
for _module, _names in HIDE.items():
    _m = importlib.import_module(_module)
    for _name in _names:
        if hasattr(_m, _name):
            delattr(_m, _name)
        if not hasattr(_m, _name):
            _absent.append(_module + "." + _name)
with open(LOG, "a") as _f:
    _f.write(json.dumps({"pid": os.getpid(), "absent": _absent}) + "\\n")
'''


def env(folder: Path, **extra: str) -> dict[str, str]:
    """``os.environ`` (plus ``extra``) with a ``sitecustomize`` in ``folder`` first on
    PYTHONPATH; each Python process started with it logs what it lacks to :func:`log` of
    ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    code = SITECUSTOMIZE.replace("HIDE", repr(NEWER_THAN_2_11)).replace(
        "LOG", repr(str(folder / "hidden.jsonl")))
    (folder / "sitecustomize.py").write_text(code)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def log(folder: Path) -> list[list[str]]:
    """Which names of :data:`NEWER_THAN_2_11` each process started with :func:`env` of
    ``folder`` lacked once its ``sitecustomize`` had run (sorted), in start order."""
    path = folder / "hidden.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [sorted(json.loads(line)["absent"]) for line in lines]


def every_name() -> list[str]:
    """``module.name`` for each name of :data:`NEWER_THAN_2_11`."""
    return [f"{m}.{n}" for m, names in NEWER_THAN_2_11.items() for n in names]

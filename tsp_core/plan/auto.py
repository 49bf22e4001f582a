"""``tsp_size="auto"``: the TSP degree every adapter asks for, decided before the mesh exists.

The choice is the planner's (:func:`tsp_core.plan.cost.auto_tsp_size`): the smallest degree D that
divides the processes of one node and whose planned per-rank peak (full recompute, bf16 AdamW) fits
the memory budget with ``headroom`` to spare. Smaller D means less communication at equal compute
per GPU, so the smallest that fits is the fastest that fits; D stays inside a node so the TSP
group rides NVLink / Infinity Fabric (``docs/cluster.md``).

It is a pure function of inputs every rank has before any process group exists (the model's
config, a sequence length, the launcher's per-node process count, the memory budget), so every
rank decides the same D without a collective, and an impossible request raises on every rank at
setup. Inputs, first found wins:

- sequence length: ``seq_len`` > ``TSP_SEQ_LEN`` > the config's ``max_position_embeddings``;
- memory per rank: ``memory_gb`` > ``TSP_MEMORY_GB`` > the smallest visible GPU's total memory >
  (CPU) the host's physical memory divided by the node's processes;
- processes per node: what the adapter knows (Lightning's ``devices``, torchrun's
  ``LOCAL_WORLD_SIZE``); with one process per GPU that is the node's GPU count.

Heterogeneous nodes (GPUs or host memory that differ between nodes) must set ``TSP_MEMORY_GB``:
otherwise ranks could read different budgets and choose different degrees.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ..baselines.layouts import LayoutSpec
from .cost import auto_tsp_size
from .memory import estimate
from .traffic import ModelShape

logger = logging.getLogger("tsp_core.auto")
GIB = 2 ** 30


@dataclass(frozen=True)
class TSPChoice:
    """The degree an adapter builds its mesh with, and why (said on rank 0: ``log_choice``)."""

    size: int
    reason: str
    auto: bool = False


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _config_of(model_config: Any, env: Mapping[str, str]) -> Any:
    """A config object with attributes: a transformers config, a model (its ``.config``), a dict,
    or a path to a checkpoint folder / ``config.json`` (also ``TSP_MODEL_CONFIG``)."""
    if model_config is None:
        model_config = env.get("TSP_MODEL_CONFIG") or None
    if model_config is None:
        return None
    if hasattr(model_config, "config") and not hasattr(model_config, "hidden_size"):
        model_config = model_config.config
    if isinstance(model_config, (str, os.PathLike)):
        path = os.fspath(model_config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            model_config = json.load(f)
    if isinstance(model_config, Mapping):
        model_config = SimpleNamespace(**model_config)
    return model_config


def _first(*pairs: tuple[Any, str]) -> tuple[Any, str]:
    for value, source in pairs:
        if value not in (None, ""):
            return value, source
    return None, ""


def node_memory(local_processes: int, env: Mapping[str, str],
                cuda_memory: Callable[[], list[int]] | None = None) -> tuple[float, str]:
    """(bytes each rank may use, where the figure came from), after ``TSP_MEMORY_GB``."""
    if env.get("TSP_MEMORY_GB"):
        return float(env["TSP_MEMORY_GB"]) * 1e9, "TSP_MEMORY_GB"
    sizes = (cuda_memory or _cuda_memory)()
    if sizes:
        return float(min(sizes)), f"GPU memory ({len(sizes)} visible, smallest)"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / max(1, local_processes), f"host memory / {local_processes} processes (no GPU)"


def _cuda_memory() -> list[int]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory
            for i in range(torch.cuda.device_count())]


def choose_tsp_size(requested: Any, *, model_config: Any = None, local_processes: int,
                    seq_len: int | None = None, memory_gb: float | None = None, batch: int = 1,
                    headroom: float = 0.1, env: Mapping[str, str] | None = None,
                    cuda_memory: Callable[[], list[int]] | None = None) -> TSPChoice:
    """``requested`` as given (an int or its string), or for ``"auto"`` the planner's choice.
    Raises ``ValueError`` naming what is missing or the binding constraint."""
    env = os.environ if env is None else env
    if not is_auto(requested):
        try:
            size = int(requested)
        except (TypeError, ValueError):
            raise ValueError(f"tsp_size must be a positive integer or 'auto', "
                             f"got {requested!r}") from None
        return TSPChoice(size, f"tsp_size={size} given")
    config = _config_of(model_config, env)
    if config is None:
        raise ValueError("tsp_size='auto' needs the model's config to plan memory, and none is "
                         "known when the mesh is built: pass the model config "
                         "(tsp_model_config=... , or TSP_MODEL_CONFIG=path/to/config.json) or set "
                         "tsp_size yourself")
    seq, seq_src = _first((seq_len, "given"), (env.get("TSP_SEQ_LEN"), "TSP_SEQ_LEN"),
                          (getattr(config, "max_position_embeddings", None),
                           "the model's max_position_embeddings"))
    if seq is None:
        raise ValueError("tsp_size='auto' needs a sequence length: pass tsp_seq_len=... or set "
                         "TSP_SEQ_LEN (the config has no max_position_embeddings)")
    seq = int(seq)
    if memory_gb is not None:
        memory, mem_src = float(memory_gb) * 1e9, "given"
    else:
        memory, mem_src = node_memory(local_processes, env, cuda_memory)
    shape = ModelShape.from_config(config)
    try:
        d = auto_tsp_size(shape, seq, local_processes, memory, batch, headroom)
    except ValueError as err:
        raise ValueError(f"tsp_size='auto': {err} [sequence length from {seq_src}, memory from "
                         f"{mem_src}]") from None
    peak = estimate(shape, LayoutSpec("tsp", d), seq, batch).peak
    reason = (f"tsp_size='auto' chose D={d}: the smallest degree dividing {local_processes} "
              f"processes per node whose planned peak ({peak / GIB:.2f} GiB) fits "
              f"{memory * (1 - headroom) / GIB:.2f} GiB ({memory / 1e9:.1f} GB from {mem_src}, "
              f"{headroom:.0%} headroom) for {seq} tokens (from {seq_src}) x batch {batch}")
    if d > 1:
        smaller = max(x for x in range(1, d) if local_processes % x == 0)
        reason += (f"; D={smaller} would need "
                   f"{estimate(shape, LayoutSpec('tsp', smaller), seq, batch).peak / GIB:.2f} GiB")
    return TSPChoice(d, reason, auto=True)


def resolve_degree(given: Any, *, local_processes: int, env: Mapping[str, str] | None = None,
                   **planning: Any) -> TSPChoice:
    """The rule every adapter shares for its TSP degree: ``given`` (an int, its string or
    ``"auto"``) > ``TSP_SIZE`` in the environment (launchers pass it to every worker) > every
    process of a node. ``planning``: what :func:`choose_tsp_size` takes for ``"auto"``."""
    env = os.environ if env is None else env
    requested = given if given is not None else (env.get("TSP_SIZE") or None)
    if requested is None:
        return TSPChoice(local_processes,
                         f"tsp_size unset: every process of a node ({local_processes})")
    return choose_tsp_size(requested, local_processes=local_processes, env=env, **planning)


def log_choice(choice: TSPChoice, env: Mapping[str, str] | None = None) -> None:
    """Say the degree "auto" chose, once, on global rank 0 (``RANK``): a warning of the
    ``tsp_core.auto`` logger when logging is configured (a script such as Hugging Face's
    ``run_clm.py`` leaves the root logger at WARNING with a handler, where an info would vanish),
    otherwise a ``[tsp]`` line on stderr."""
    env = os.environ if env is None else env
    if env.get("RANK", "0") != "0" or not choice.auto:
        return
    if logger.hasHandlers():
        logger.warning(choice.reason)
    else:
        print(f"[tsp] {choice.reason}", file=sys.stderr, flush=True)

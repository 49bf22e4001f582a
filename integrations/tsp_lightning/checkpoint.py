"""Checkpoints of the Lightning strategies (Trainer and Fabric) in formats that load at any TSP
degree and data-parallel size.

- ``save_distributed_checkpoint=True`` (default): a directory written by
  :func:`tsp_core.save_checkpoint`: every weight and optimizer tensor under its name and
  Hugging Face shape through torch.distributed.checkpoint, each rank writing the chunks it owns;
  Lightning's own entries (epoch, global step, loops, callbacks, LR schedulers, precision state,
  hyperparameters; or Fabric's user values) travel as its ``extra`` value, pickled as Lightning
  pickles its ``meta.pt``.
- ``save_distributed_checkpoint=False``: one file in Lightning's ordinary single-file format with
  the full, Hugging Face-shaped weights and optimizer state, assembled on rank 0
  (:func:`tsp_core.full_state_dict`, :func:`tsp_core.state.resharding.full_optimizer_state_dict`),
  so any strategy, a plain single-device one too, resumes from it.

Either loads into the TSP strategies at any degree; the older local-layout folders (Lightning's
``meta.pt`` beside DCP shards of the padded local tensors) still load at the degree that wrote them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import tsp_core
from tsp_core.state.checkpoint import check_full_state_dict
from tsp_core.state.resharding import (
    MARKER,
    check_full_optimizer_state_dict,
    full_optimizer_state_dict,
    load_full_optimizer_state_dict,
)

META_KEY = "lightning"  # the extra value of a tsp_core checkpoint holding Lightning's entries


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_reshardable(path: Path) -> bool:
    return (path / MARKER).is_file()


def save_reshardable(path: Path, module: nn.Module, optimizers: list, metadata: dict) -> None:
    if _rank0() and path.is_file():
        path.unlink()  # a one-file checkpoint of the same name is replaced by the directory
    tsp_core.save_checkpoint(path, module, optimizers or None, extra_weights_only=False,
                             **{META_KEY: metadata})


def load_reshardable(path: Path, module: nn.Module, optimizers: list,
                     weights_only: bool | None) -> dict[str, Any]:
    """Lightning's entries; ``weights_only=None`` is torch's default (True), as for Lightning's
    own ``meta.pt``."""
    extra = tsp_core.load_checkpoint(path, module, optimizers or None,
                                     weights_only=weights_only is not False)
    return extra[META_KEY]


def save_one_file(path: Path, module: nn.Module, optimizers: list,
                  assemble: Callable[[dict, list[dict]], dict]) -> None:
    """``assemble(full model state, full optimizer states)`` -> the dict rank 0 writes to ``path``
    (through ``path.partial`` and a rename, so a killed save leaves no half-written file)."""
    if path.is_dir():
        if not (is_reshardable(path) or (path / "meta.pt").is_file()):
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
        _barrier()
        if _rank0():
            shutil.rmtree(path)  # a sharded checkpoint of the same name is replaced by the file
    model_sd = tsp_core.full_state_dict(module)  # every rank gathers
    osds = [full_optimizer_state_dict(module, o, rank0_only=True) for o in optimizers]
    if _rank0():
        tmp = str(path) + ".partial"
        os.makedirs(path.parent, exist_ok=True)
        torch.save(assemble(model_sd, osds), tmp)
        os.replace(tmp, path)
    _barrier()


def read_one_file(path: Path, weights_only: bool | None) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only is not False)


def load_one_file(module: nn.Module, model_sd: dict, optimizers: list, osds: list | None,
                  path: Path) -> None:
    """Each rank keeps its slices of the full weights and optimizer states. The weights and
    every optimizer state are checked before any of them changes: a file that does not fit
    raises on every rank and changes nothing."""
    if optimizers and osds is None:
        raise ValueError(f"{path} holds only the model (saved with weights_only=True / "
                         f"save_weights_only=True): it cannot resume training")
    if optimizers and len(osds) != len(optimizers):
        raise ValueError(f"{path} holds the state of {len(osds)} optimizer(s), the model has "
                         f"{len(optimizers)}")
    check_full_state_dict(module, model_sd)
    for opt, osd in zip(optimizers, osds or []):
        check_full_optimizer_state_dict(module, opt, osd)
    tsp_core.load_full_state_dict(module, model_sd)
    for opt, osd in zip(optimizers, osds or []):
        load_full_optimizer_state_dict(module, opt, osd)

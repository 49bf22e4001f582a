"""Features of tsp_core that need a newer torch than the oldest it runs on (docs/gpu.md "Torch
versions").

tsp_core imports, and runs its TSP schedules, on torch 2.11 (the GPU image's torch); it is tested
on 2.13. A feature that needs a newer torch imports what it needs where it is used and asks here
first, so on an older torch ``import tsp_core`` still works and the feature refuses with its name
and the torch it needs, before any collective, instead of failing at import or halfway through a
setup. Each feature is probed by the symbol it needs rather than by the version string, so a
nightly or patched build that has the symbol is let through.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


class TorchTooOld(RuntimeError):
    """A feature was asked for that this torch lacks."""


@dataclass(frozen=True)
class Feature:
    """What the user asks for (``name``), the first torch that has it and the symbol it needs."""

    name: str
    min_torch: str
    module: str
    symbol: str
    fix: str


FSDP2_SPMD = Feature(
    name="FSDP2 on the TSP mesh (init_mesh(..., dp_shard=N) with N > 1, FSDP2 in the adapters)",
    min_torch="2.12",
    module="torch.distributed.fsdp._fully_shard._fsdp_api",
    symbol="DataParallelMeshDims",
    fix="install torch>=2.12, or train without FSDP2: init_mesh(tsp_size, dp_size) replicates "
        "each TSP group over data parallel (1/D of the model state per rank instead of "
        "1/(D x N))")

FEATURES: tuple[Feature, ...] = (FSDP2_SPMD,)


def available(feature: Feature) -> bool:
    """Whether this torch has the symbol ``feature`` needs."""
    try:
        module = importlib.import_module(feature.module)
    except ImportError:
        return False
    return hasattr(module, feature.symbol)


def require(feature: Feature) -> None:
    """Raise :class:`TorchTooOld`, naming the feature, the torch it needs and this one, unless
    this torch has it."""
    if not available(feature):
        raise TorchTooOld(f"{feature.name} needs torch >= {feature.min_torch} "
                          f"({feature.module}.{feature.symbol}); this is torch "
                          f"{torch.__version__}: {feature.fix}")


def one_buffer_collective(name: str, before_2_12: str) -> Callable:
    """``torch.distributed``'s one-buffer all-gather or reduce-scatter: ``name`` from torch 2.12
    on (where ``before_2_12``, the only name torch 2.11 has, is deprecated and warns). Looked up
    at each call, so that a test that wraps ``torch.distributed``'s function sees the call."""
    return getattr(dist, name, None) or getattr(dist, before_2_12)

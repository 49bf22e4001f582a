"""FSDP2 over the data-parallel axis of a TSP mesh (docs/design.md "FSDP2 on the data-parallel
axis").

TSP leaves every rank 1/D of each weight; ``fully_shard`` then splits each rank's TSP shard over
the mesh's ``shard_dim`` ("dp_shard"), so parameters, gradients and optimizer state are
1/(D * dp_shard) of the model per rank. TSP parameters are already DTensors on the whole mesh,
``Replicate`` on every data-parallel dim: exactly what FSDP2's SPMD-mesh mode
(``dp_mesh_dims``) takes, so FSDP2 shards each one along dim 0 of its local tensor and hands the
TSP schedules the whole 1/D shard, all-gathered per decoder layer, inside forward and backward.

Gradients: the TSP loss is the global mean, so data-parallel gradients must be *summed*, not
averaged: FSDP2's divide factor is set to 1, with sum-only reductions (a plain SUM). Replica dims
(HSDP) are summed by an all-reduce hook on the reduce-scattered gradient. FSDP2's all-gathers,
reduce-scatters and that all-reduce go through :mod:`tsp_core.comm`, so they are counted like
every other collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

from . import comm
from .mesh import TSPMesh
from .torch_features import FSDP2_SPMD, require


class _CountedAllGather(DefaultAllGather):
    """FSDP2's parameter all-gather through :func:`tsp_core.comm.all_gather`."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False):
        return comm.all_gather(output_tensor, input_tensor, group, async_op=async_op)


class _CountedReduceScatter(DefaultReduceScatter):
    """FSDP2's gradient reduce-scatter through :func:`tsp_core.comm.reduce_scatter` (a sum: the
    divide factor is 1)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op=dist.ReduceOp.SUM, async_op: bool = False):
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(f"FSDP2 asked for reduce op {op}; TSP sums data-parallel "
                               f"gradients (divide factor 1)")
        return comm.reduce_scatter(output_tensor, input_tensor, group, async_op=async_op)


def _sum_over_replicas(groups: list[dist.ProcessGroup]):
    def hook(reduced: torch.Tensor) -> None:
        for group in groups:
            comm.all_reduce(reduced, group)
    return hook


def apply_fsdp(model: nn.Module, mesh: TSPMesh, units: list[nn.Module], *,
               mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` each module of ``units`` (the decoder layers), then ``model`` (the root:
    embedding, final norm, LM head), over ``mesh.shard_dim``; data-parallel gradients summed over
    the shard dim and every replica dim."""
    if mesh.shard_dim is None:
        raise ValueError("the mesh names no data-parallel dim to shard over (shard_dim); build it "
                         "with tsp_core.init_mesh(..., dp_shard=N)")
    require(FSDP2_SPMD)  # torch >= 2.12: imported here so that tsp_core imports on older torch
    from torch.distributed.fsdp._fully_shard._fsdp_api import DataParallelMeshDims

    # FSDP2 wants the very mesh object the parameters' DTensors hold, which was not
    # mesh.device_mesh but an equal one after a second init_mesh of that shape in one process
    spmd = next(p.device_mesh for p in model.parameters())
    kwargs = dict(mesh=spmd, dp_mesh_dims=DataParallelMeshDims(shard=mesh.shard_dim),
                  reshard_after_forward=reshard_after_forward,
                  mp_policy=mp_policy or MixedPrecisionPolicy())
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    dm = mesh.device_mesh
    replicas = [dm.get_group(n) for n in mesh.replicate_dims
                if dm.size(dm.mesh_dim_names.index(n)) > 1]
    for module in [*units, model]:
        assert isinstance(module, FSDPModule)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM, not PREMUL_SUM(1)
        module.set_custom_all_gather(_CountedAllGather())
        module.set_custom_reduce_scatter(_CountedReduceScatter())
        if replicas:
            module.set_all_reduce_hook(_sum_over_replicas(replicas))
    return model


@contextlib.contextmanager
def root_unsharded(model: nn.Module) -> Iterator[None]:
    """Hold the root's parameters (embedding, final norm, LM head) whole while code calls the
    model's parts instead of its forward (generation's prefill and decode steps); the decoder
    layers still gather their own in their forward. Nothing to do without FSDP2."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model._get_fsdp_state()._lazy_init()  # the root is the model, as its forward would decide
    model.unshard()
    try:
        yield
    finally:
        model.reshard()

"""TSP parameters as DTensors on the mesh: ``Shard`` on the TSP dim for owned slices,
``Replicate`` everywhere else (INTEGRATION_NOTES: DCP, grad clipping and save_pretrained need
DTensors). The schedules compute on ``to_local()`` views.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import comm
from .mesh import TSPMesh


def _placements(mesh: TSPMesh, shard_dim: int | None):
    names = mesh.device_mesh.mesh_dim_names
    return [Shard(shard_dim) if (n == mesh.dim and shard_dim is not None) else Replicate()
            for n in names]


def sharded_parameter(local: torch.Tensor, mesh: TSPMesh, dim: int) -> nn.Parameter:
    """A parameter whose local tensor is this rank's slice along ``dim`` of the full tensor."""
    shape = list(local.shape)
    shape[dim] *= mesh.size
    dt = DTensor.from_local(local.detach(), mesh.device_mesh, _placements(mesh, dim),
                            run_check=False, shape=torch.Size(shape),
                            stride=torch.empty(shape, device="meta").stride())
    return nn.Parameter(dt)


def replicated_parameter(full: torch.Tensor, mesh: TSPMesh) -> nn.Parameter:
    """A parameter every rank holds whole (norm weights, biases of row-parallel outputs)."""
    dt = DTensor.from_local(full.detach(), mesh.device_mesh, _placements(mesh, None),
                            run_check=False)
    return nn.Parameter(dt)


def local(param: torch.Tensor) -> torch.Tensor:
    """The local tensor of a sharded parameter (differentiable)."""
    return param.to_local() if isinstance(param, DTensor) else param


def local_replicated(param: torch.Tensor, mesh: TSPMesh) -> torch.Tensor:
    """The local copy of a replicated parameter, whose gradient is summed over the TSP group
    (each rank saw different tokens)."""
    return comm.sum_grad(local(param), mesh.group)


def shard_slice(full: torch.Tensor, mesh: TSPMesh, dim: int) -> torch.Tensor:
    """This rank's equal slice of ``full`` along ``dim`` (a copy)."""
    size = full.shape[dim]
    if size % mesh.size:
        raise ValueError(f"tsp_size ({mesh.size}) must divide dim {dim} of size {size}")
    n = size // mesh.size
    return full.narrow(dim, mesh.rank * n, n).clone()


def local_weights(module: nn.Module, names: list[str], x: torch.Tensor) -> list[torch.Tensor]:
    """Local tensors of ``module``'s named parameters, after checking that they share the input's
    dtype (a round packs them into one buffer)."""
    weights = [local(getattr(module, n)) for n in names]
    for n, w in zip(names, weights):
        if w.dtype != x.dtype:
            raise ValueError(f"{type(module).__name__}: input dtype ({x.dtype}) differs from "
                             f"{n} ({w.dtype}); every weight shard and the input must share one "
                             f"dtype: cast with .to({x.dtype})")
    return weights

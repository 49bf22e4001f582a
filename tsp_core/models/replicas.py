"""Data-parallel replicas must start from the same weights. DDP makes sure of it by broadcasting
rank 0's parameters when it wraps the model; ``parallelize`` takes each rank's slices of the
model that rank built, so replicas built from different random seeds (torch seeds each process
differently) would train different models, silently. One small all-gather of per-tensor sums
over each data-parallel dim finds that and refuses, naming the first tensor that differs."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ..distributed import comm
from ..distributed.mesh import TSPMesh

# relative difference of two ranks' sums above which their tensors differ: identical tensors
# give identical sums; two random initialisations differ in the first digits
TOLERANCE = 1e-9


def fingerprint(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
    """The names and, per floating-point tensor, its sum and its norm in float64."""
    names, values = [], []
    for name, t in tensors:
        if t.is_floating_point():
            names.append(name)
            values += [t.sum(dtype=torch.float64), torch.linalg.vector_norm(t, dtype=torch.float64)]
    return names, torch.stack(values) if values else torch.zeros(0, dtype=torch.float64)


def check_replicas_agree(mesh: TSPMesh, tensors: list[tuple[str, torch.Tensor]],
                         with_tsp: bool = False) -> None:
    """Raise on every rank when the ranks of a data-parallel dim (``with_tsp``: or of the TSP
    group, for tensors every rank holds whole, LoRA adapters) hold different ``tensors`` (the
    full weights each rank is about to take its slices of). No collective without data
    parallelism (or, ``with_tsp``, on one rank)."""
    dm = mesh.device_mesh
    dim_names = [*mesh.other_dims, *([mesh.dim] if with_tsp else [])]
    dims = [(n, dm.size(dm.mesh_dim_names.index(n))) for n in dim_names]
    dims = [(n, size) for n, size in dims if size > 1]
    if not dims or any(is_fake(t) for _, t in tensors):
        return  # no data parallelism, or the memory simulation (fake tensors hold no values)
    names, local = fingerprint(tensors)
    device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
              else torch.device("cpu"))
    local = local.to(device)
    for dim, size in dims:
        every = torch.empty(size, *local.shape, dtype=local.dtype, device=device)
        comm.all_gather(every, local, dm.get_group(dim))
        scale = every.abs().amax(dim=0).clamp_min(1.0)
        differs = ((every - every[0]).abs().amax(dim=0) > TOLERANCE * scale).nonzero()
        if len(differs):
            name = names[int(differs[0]) // 2]
            who = ("the ranks of the TSP group, which each hold these tensors whole,"
                   if dim == mesh.dim else "the data-parallel replicas")
            raise ValueError(
                f"{who} (mesh dim {dim!r}, {size} ranks) hold different "
                f"weights, {name} first: build the model from the same seed on every rank "
                f"(torch.manual_seed(...) before creating it) or load the same checkpoint. "
                f"DDP hides this by broadcasting rank 0's weights; each TSP rank takes its "
                f"slices of the model it was given")

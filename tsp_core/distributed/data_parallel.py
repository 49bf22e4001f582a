"""Data parallel around TSP groups: every parameter's gradient is summed over the mesh dims other
than TSP (the loss is already the global mean, so a sum, not an average, gives the gradient of a
single process that sees the whole global batch).

The hooks sit on the incoming gradient (``Tensor.register_hook``), so gradient accumulation over
micro-batches stays exact. ``module.to()`` creates new parameter objects without hooks
(checked by experiment), so hooks are (re)installed lazily before every forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import comm
from .mesh import TSPMesh
from .model_state import find_model_state


def _sum_over_dp(groups):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor):
            g = grad.to_local().clone()
            for group in groups:
                comm.all_reduce(g, group)
            return DTensor.from_local(g, grad.device_mesh, grad.placements, run_check=False,
                                      shape=grad.shape, stride=grad.stride())
        g = grad.clone()
        for group in groups:
            comm.all_reduce(g, group)
        return g

    return hook


def install_gradient_sync(model: nn.Module, mesh: TSPMesh) -> Any:
    """Sum gradients over every non-TSP mesh dim of size > 1 (nothing to do without one).
    Returns the hook's handle (None without one), which a converted model's state also keeps
    (``gradient_sync``) for :func:`remove_gradient_sync`."""
    dm = mesh.device_mesh
    groups = [dm.get_group(n) for n in mesh.other_dims if dm.size(dm.mesh_dim_names.index(n)) > 1]
    if not groups:
        return None
    hook = _sum_over_dp(groups)

    def ensure_hooks(_module: nn.Module, _args) -> None:
        for p in model.parameters():
            if p.requires_grad and not getattr(p, "_tsp_dp_hooked", False):
                p.register_hook(hook)
                p._tsp_dp_hooked = True

    handle = model.register_forward_pre_hook(ensure_hooks)
    state = find_model_state(model)
    if state is not None:
        state.gradient_sync = handle
    return handle


def remove_gradient_sync(model: nn.Module) -> None:
    """Leave data-parallel gradients to an engine that syncs them itself (DeepSpeed), before the
    first forward installs any hook."""
    state = find_model_state(model)
    if state is not None and state.gradient_sync is not None:
        state.gradient_sync.remove()
        state.gradient_sync = None

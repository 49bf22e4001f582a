"""RMSNorm with a replicated weight whose gradient is summed over the TSP group (every rank
normalises different tokens with the same weight)."""

from __future__ import annotations

import torch
from torch import nn

from .mesh import TSPMesh
from .params import local_replicated, replicated_parameter


class TSPRMSNorm(nn.Module):
    """Llama-style RMSNorm: ``weight * x / sqrt(mean(x^2) + eps)``, computed in float32."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.mesh, self.eps = mesh, eps
        self.weight = replicated_parameter(torch.ones(hidden_size, dtype=dtype, device=device), mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return local_replicated(self.weight, self.mesh) * x32.to(dtype)

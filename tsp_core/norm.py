"""RMSNorm with a replicated weight whose gradient is summed over the TSP group (every rank
normalises different tokens with the same weight)."""

from __future__ import annotations

import torch

from .mesh import TSPMesh
from .params import REPLICATED, ShardedModule, ShardSpec, init_full, local_replicated


class TSPRMSNorm(ShardedModule):
    """Llama-style RMSNorm with the Hugging Face numerics (normalised in float32 whatever the
    input dtype, then cast back and scaled), so a parallelized model gives HF's numbers."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.mesh, self.eps = mesh, eps
        self.full_shapes = {"weight": (hidden_size,)}
        self._create(init_full(self.full_shapes, 0, dtype, device, ones=("weight",)))

    def extra_repr(self) -> str:
        return f"{self.full_shapes['weight']}, eps={self.eps}"

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        return REPLICATED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, local_replicated(self.weight, self.mesh), self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm over the last dim: normalised in float32 whatever the input
    dtype, cast back, then scaled (also the per-head q/k norm of Qwen3)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)

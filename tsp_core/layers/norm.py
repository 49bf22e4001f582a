"""RMSNorm with a replicated weight whose gradient is summed over the TSP group (every rank
normalises different tokens with the same weight), in each family's own numerics."""

from __future__ import annotations

from typing import Callable

import torch

from ..distributed.mesh import TSPMesh
from ..distributed.params import REPLICATED, ShardedModule, ShardSpec, init_full, local_replicated


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm over the last dim: normalised in float32 whatever the input
    dtype, cast back, then scaled (also the per-head q/k norm of Qwen3)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (Gemma 1-3, their q/k norms too): scaled by ``1 + weight`` in float32,
    then cast back (the weight is stored as an offset from one). A float64 model stays in
    float64 (Hugging Face's ``.float()`` would round it, and its weight gradient, to float32)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    xa = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    return (xa * (1.0 + weight.to(acc))).type_as(x)


def olmo2_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """OLMo 2's RMSNorm (its q/k norms too): normalised in float32 whatever the input dtype,
    scaled by the weight *before* the cast back (Llama casts, then scales)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32).to(dtype)


NORMS: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "llama": rms_norm, "gemma": gemma_rms_norm, "olmo2": olmo2_rms_norm}


class TSPRMSNorm(ShardedModule):
    """RMSNorm with the Hugging Face numerics of ``kind`` (:data:`NORMS`: "llama", or "gemma"
    whose weight is an offset from one), so a parallelized model gives HF's numbers."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, eps: float = 1e-6, kind: str = "llama",
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        if kind not in NORMS:
            raise ValueError(f"unknown RMSNorm kind {kind!r}; one of {sorted(NORMS)}")
        self.mesh, self.eps, self.kind = mesh, eps, kind
        self.full_shapes = {"weight": (hidden_size,)}
        full = init_full(self.full_shapes, 0, dtype, device, ones=("weight",))
        if kind == "gemma":  # the identity is a zero offset
            full["weight"].zero_()
        self._create(full)

    def extra_repr(self) -> str:
        return f"{self.full_shapes['weight']}, eps={self.eps}, kind={self.kind}"

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        return REPLICATED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NORMS[self.kind](x, local_replicated(self.weight, self.mesh), self.eps)

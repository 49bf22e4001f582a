"""A linear layer that every rank of the TSP group holds whole: for small per-token projections
(Gemma 4's per-layer inputs) whose weights cost less than moving them. Each rank applies it to
its own tokens; the weight's gradient is summed over the group, as a norm's is
(:mod:`tsp_core.layers.norm`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed.mesh import TSPMesh
from ..distributed.params import REPLICATED, ShardedModule, ShardSpec, init_full, local_replicated


class TSPReplicatedLinear(ShardedModule):
    """``nn.Linear(in_features, out_features, bias)`` replicated over the TSP group, under
    Hugging Face's names (``weight`` [out, in], ``bias`` [out])."""

    def __init__(self, mesh: TSPMesh, in_features: int, out_features: int, bias: bool = False, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 init_seed: int | None = 0) -> None:
        super().__init__()
        self.mesh, self.in_features, self.out_features = mesh, in_features, out_features
        self.full_shapes = {"weight": (out_features, in_features)}
        if bias:
            self.full_shapes["bias"] = (out_features,)
        self._create(init_full(self.full_shapes, init_seed, dtype, device))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={'bias' in self.full_shapes}, replicated over tsp_size={self.mesh.size}")

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        return REPLICATED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = local_replicated(self.bias, self.mesh) if "bias" in self.full_shapes else None
        return F.linear(x, local_replicated(self.weight, self.mesh), bias)

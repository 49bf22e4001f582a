"""The TSP Gated DeltaNet ``nn.Module`` (Qwen3.5's linear-attention layers): the shards this rank
owns, under Hugging Face's names and shapes, the checks on its inputs, and the schedule."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...distributed import comm
from ...distributed.mesh import TSPMesh
from ...distributed.params import (
    REPLICATED,
    ShardedModule,
    ShardSpec,
    even_spec,
    init_full,
    schedule_inputs,
)
from ..inputs import check_local_input, checked_docs
from .schedule import DeltaNetSpec, GatedDeltaNetFn

# this rank's shards, in the schedule's round order (DeltaNetSpec.round_shapes)
ROUND_WEIGHTS = ["in_proj_q.weight", "in_proj_k.weight", "in_proj_v.weight", "in_proj_z.weight",
                 "in_proj_b.weight", "in_proj_a.weight", "conv1d_q.weight", "conv1d_k.weight",
                 "conv1d_v.weight", "A_log", "dt_bias", "out_proj.weight"]


def check_delta_net_shape(tsp_size: int, num_k_heads: int, num_v_heads: int) -> None:
    """Raise, naming the numbers, when the heads cannot be split over ``tsp_size`` ranks: each
    rank owns whole key heads and the value heads that repeat them."""
    if num_k_heads < 1 or num_v_heads % num_k_heads:
        raise ValueError(f"linear_num_key_heads ({num_k_heads}) must divide "
                         f"linear_num_value_heads ({num_v_heads})")
    if num_k_heads % tsp_size:
        raise ValueError(f"tsp_size ({tsp_size}) must divide linear_num_key_heads "
                         f"({num_k_heads}) (and so linear_num_value_heads, {num_v_heads}): each "
                         f"rank owns whole key heads and the value heads that repeat them")


class TSPGatedDeltaNet(ShardedModule):
    """Qwen3.5's ``Qwen3_5GatedDeltaNet`` under TSP. Rank p owns key heads
    [p*nk/D, (p+1)*nk/D) and value heads [p*nv/D, (p+1)*nv/D) (value head j repeats key head
    j // (nv/nk), so these belong together): their rows of ``in_proj_qkv`` (q, k and v parts,
    kept as ``in_proj_q``/``_k``/``_v`` and named as the fused Hugging Face tensor), of
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, their ``conv1d`` channels (likewise),
    ``A_log`` and ``dt_bias``, and their columns of ``out_proj``. ``norm.weight`` [d_v] is shared
    by every head: replicated, its gradient summed over the group.

    ``forward(x, docs=None)`` takes this rank's tokens [B, S/D, hidden]; with ``docs`` (packed
    rows, as ``shard_batch`` gives them) the state and the convolution restart at every
    document."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, num_k_heads: int, num_v_heads: int,
                 head_k_dim: int, head_v_dim: int, conv_kernel: int, eps: float = 1e-6, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 init_seed: int | None = 0) -> None:
        super().__init__()
        check_delta_net_shape(mesh.size, num_k_heads, num_v_heads)
        if conv_kernel < 1:
            raise ValueError(f"linear_conv_kernel_dim ({conv_kernel}) must be at least 1")
        self.mesh = mesh
        self.spec = DeltaNetSpec(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                                 conv_kernel, mesh.size, mesh.layout, eps)
        h, K = hidden_size, conv_kernel
        kd, vd = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.full_shapes = {
            "in_proj_q.weight": (kd, h), "in_proj_k.weight": (kd, h), "in_proj_v.weight": (vd, h),
            "in_proj_z.weight": (vd, h), "in_proj_b.weight": (num_v_heads, h),
            "in_proj_a.weight": (num_v_heads, h), "conv1d_q.weight": (kd, 1, K),
            "conv1d_k.weight": (kd, 1, K), "conv1d_v.weight": (vd, 1, K),
            "A_log": (num_v_heads,), "dt_bias": (num_v_heads,), "out_proj.weight": (h, vd),
            "norm.weight": (head_v_dim,)}
        full = init_full(self.full_shapes, init_seed, dtype, device,
                         ones=("norm.weight", "dt_bias"))
        self._create(full)
        self.fuse({"in_proj_qkv": ("in_proj_q", "in_proj_k", "in_proj_v")})
        self.fuse_tensors("conv1d.weight", ("conv1d_q.weight", "conv1d_k.weight",
                                            "conv1d_v.weight"), 0)

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden_size={s.hidden_size}, heads={s.num_k_heads}/{s.num_v_heads}, "
                f"head_dims={s.head_k_dim}/{s.head_v_dim}, conv_kernel={s.conv_kernel}, "
                f"tsp_size={s.tsp_size}")

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        if name == "norm.weight":
            return REPLICATED
        dim = 1 if name == "out_proj.weight" else 0
        return even_spec(self.full_shapes[name][dim], rank, self.spec.tsp_size, dim)

    def forward(self, x: torch.Tensor, docs: Sequence[Sequence[int]] | None = None
                ) -> torch.Tensor:
        s = self.spec
        check_local_input(x, s.hidden_size)
        docs = checked_docs(docs, x, s.tsp_size)
        x, weights, context = schedule_inputs(self, ROUND_WEIGHTS + ["norm.weight"], x)
        norm_w = comm.sum_grad(weights.pop(), self.mesh.group)
        with context:
            return GatedDeltaNetFn.apply(x, norm_w, s, self.mesh.group, docs, *weights)

"""Context parallelism (the paper's "SP"): weights replicated, tokens split zigzag over the ``cp``
mesh dim, K/V all-gathered per layer.

It is installed as a Hugging Face attention implementation, so the model's own projections, RoPE
(at global positions) and residuals run unchanged; only the core attention sees the whole
sequence. The core is the same flash-piece kernel as TSP's (docs/design.md "Attention") and, like
TSP, the backward keeps only the local K/V and gathers the rest again: the strongest form of the
layout, measured with the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import comm
from ..distributed.chunks import row_segments
from ..layers import flash

ATTN_IMPLEMENTATION = "tsp_context_parallel"


@dataclass(frozen=True)
class CPAttention:
    """What one attention layer needs to know about the context-parallel group."""

    group: dist.ProcessGroup
    size: int
    rank: int
    layout: str
    window: int | None

    def pieces(self, local_len: int) -> list[flash.Piece]:
        seq = local_len * self.size
        return flash.plan_pieces(row_segments((seq,), self.rank, self.size, self.layout), seq,
                                 True, self.window)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: CPAttention, scale: float):
        pieces = cp.pieces(q.shape[2])
        kv_local = torch.stack((k, v))  # [2, B, Hkv, L, d]
        kv = comm.all_gather_sequence(kv_local, cp.group, 3, cp.layout)
        out, lse = flash.attention_forward(q, kv[0], kv[1], pieces, scale)
        ctx.cp, ctx.scale, ctx.pieces = cp, scale, pieces
        ctx.save_for_backward(q, kv_local, out, lse)
        return out

    @staticmethod
    def backward(ctx, do):
        q, kv_local, out, lse = ctx.saved_tensors
        cp = ctx.cp
        kv = comm.all_gather_sequence(kv_local, cp.group, 3, cp.layout)
        dq, dkv = flash.attention_backward(do.contiguous(), q, kv, out, lse, ctx.pieces, ctx.scale)
        del kv
        # the pieces' gradients were summed in float32: one cast, then the reduce-scatter
        dkv = comm.reduce_scatter_sequence(dkv.to(kv_local.dtype), cp.group, 3, cp.layout)
        return dq, dkv[0], dkv[1], None, None


def context_parallel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None,
                               scaling: float | None = None, dropout: float = 0.0,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface signature: q [B, Hq, L, d], k/v [B, Hkv, L, d] of the
    local tokens (RoPE applied); returns [B, L, Hq, d]."""
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported by the baselines")
    cp: CPAttention = module._tsp_cp
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _ContextParallelAttention.apply(query.contiguous(), key.contiguous(),
                                          value.contiguous(), cp, scale)
    return out.transpose(1, 2), None


def install(model: nn.Module, layers: list[nn.Module], attention: str, group: dist.ProcessGroup,
            layout: str, windows: list[int | None]) -> None:
    """Route every layer's core attention through :func:`context_parallel_attention`."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, context_parallel_attention)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for layer, window in zip(layers, windows):
        getattr(layer, attention)._tsp_cp = CPAttention(group, size, rank, layout, window)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

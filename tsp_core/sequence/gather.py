"""Every rank's local per-token values gathered into the full sequence, in the original token
order, identical on every rank of the TSP group (the fused LM head's full-sequence fields, full
logits for evaluation)."""

from __future__ import annotations

import torch

from ..distributed import comm


class GatherTokens(torch.autograd.Function):
    """Every rank's local per-token values ``[B, L, ...]`` in ``index``'s order ``[B, S, ...]``
    (an all-gather); the backward keeps this rank's positions of the gradient, since every rank
    computes the same result from them."""

    @staticmethod
    def forward(ctx, x, index, group):
        d, (b, n) = group.size(), x.shape[:2]
        buf = x.new_empty((d, *x.shape))
        comm.all_gather(buf, x.contiguous(), group)
        ctx.index, ctx.shape, ctx.rank = index, (d, *x.shape), group.rank()
        return buf[index // n, torch.arange(b, device=x.device)[:, None], index % n]

    @staticmethod
    def backward(ctx, g):
        d, b, n = ctx.shape[:3]
        full = g.new_zeros(ctx.shape)
        full[ctx.index // n, torch.arange(b, device=g.device)[:, None], ctx.index % n] = g
        return full[ctx.rank], None, None


def gather_tokens(x: torch.Tensor, index: torch.Tensor, group) -> torch.Tensor:
    """:class:`GatherTokens` (a bool tensor travels as uint8). ``index`` [B, S]: where each
    position's token sits in the rank-order concatenation of the ranks' local tokens
    (:func:`tsp_core.inference.logits.token_index`)."""
    if x.dtype == torch.bool:
        return GatherTokens.apply(x.to(torch.uint8), index, group).bool()
    return GatherTokens.apply(x, index, group)

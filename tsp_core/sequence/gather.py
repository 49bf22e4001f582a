"""Every rank's local per-token values gathered into the full sequence, in the original token
order, identical on every rank of the TSP group (the fused LM head's full-sequence fields, full
logits for evaluation)."""

from __future__ import annotations

import torch

from ..distributed import comm
from ..distributed.chunks import row_segments


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
    (:func:`token_index`)."""
    if x.dtype == torch.bool:
        return GatherTokens.apply(x.to(torch.uint8), index, group).bool()
    return GatherTokens.apply(x, index, group)


def token_index(tsp_docs: torch.Tensor | list[list[int]], size: int, layout: str,
                original_docs: list[list[int]] | None = None) -> torch.Tensor:
    """``[B, S]``: for each position of the result, where its token sits in the rank-order
    concatenation of every rank's local tokens (what an all-gather returns), from each row's
    padded document lengths ``tsp_docs`` (``shard_batch``'s; zeros, its row padding, are
    skipped). With ``original_docs`` (each row's unpadded document lengths) the positions are the
    original tokens only, in their order; without, every padded position."""
    docs = tsp_docs.tolist() if isinstance(tsp_docs, torch.Tensor) else tsp_docs
    rows = []
    for r, row in enumerate(docs):
        padded = [n for n in row if n]
        slot_of = torch.empty(sum(padded), dtype=torch.long)
        slot = 0
        for rank in range(size):
            for a, b, _ in row_segments(padded, rank, size, layout):
                slot_of[a:b] = torch.arange(slot, slot + b - a)
                slot += b - a
        if original_docs is None:
            rows.append(slot_of)
            continue
        starts = torch.tensor([0] + padded[:-1]).cumsum(0).tolist()
        rows.append(torch.cat([slot_of[s:s + n] for s, n in zip(starts, original_docs[r])]))
    index = torch.stack(rows)
    return index.to(tsp_docs.device) if isinstance(tsp_docs, torch.Tensor) else index

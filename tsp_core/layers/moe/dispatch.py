"""Schedule "expert" (docs/moe.md (a)): each rank owns E/D whole experts; a token's routed copies
go to their experts' owners by one all-to-all and come back by another (:func:`dispatch_combine`),
the experts running on the rows they received a tile at a time (:class:`_TiledExpertsFn`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from ...distributed import comm
from ..tiles import grad_accumulator, token_tiles
from .experts import expert_views, glu, glu_backward
from .spec import MoESpec


@dataclass(frozen=True)
class _Splits:
    """How one MoE layer's routed copies move: rows this rank sends to / receives from each rank,
    and how many it receives per (source rank, local expert)."""

    send: list[int]
    recv: list[int]
    received: list[list[int]]

    @property
    def per_expert(self) -> list[int]:
        return [sum(col) for col in zip(*self.received)]


def _splits(experts: torch.Tensor, spec: MoESpec, group) -> _Splits:
    """The splits of this rank's top-k ``experts`` [N, k]: per-expert counts, then one
    all-to-all of them (E/D counts to and from every rank). Under fake tensors (``tsp
    simulate``), where routing has no values, those of uniform routing."""
    D, E, per = spec.tsp_size, spec.num_experts, spec.local_experts
    if is_fake(experts):
        n, me = experts.numel(), dist.get_rank(group)
        sent = [n // E + (e < n % E) for e in range(E)]
        received = [sent[me * per:(me + 1) * per] for _ in range(D)]
    else:
        counts = torch.bincount(experts.reshape(-1), minlength=E)
        got = torch.empty_like(counts)
        comm.all_to_all(got, counts, group)
        sent, received = counts.tolist(), got.view(D, per).tolist()
    return _Splits([sum(sent[r * per:(r + 1) * per]) for r in range(D)],
                   [sum(row) for row in received], received)


class _TiledExpertsFn(torch.autograd.Function):
    """This rank's experts on the rows they received, grouped by expert (``sizes`` rows each),
    ``tile`` rows at a time: each expert's gate, up and down projections (:func:`expert_views` of
    ``experts``: ``gate_up``, ``down`` and, with expert biases, ``gate_up_bias``, as Hugging Face
    stores them) and its activation (:func:`glu`). The backward recomputes a tile's gate, up and
    activation at a time, so only the rows are kept and the working set is a few [tile, F]
    tensors, not the intermediates of every received row."""

    @staticmethod
    def forward(ctx, rows, sizes: list[int], tile: int, spec: MoESpec, *experts):
        out = rows.new_empty(rows.shape)
        start = 0
        for e, n in enumerate(sizes):
            wg, wu, wd, bg, bu = expert_views(spec, experts, e)
            for sl in token_tiles(n, tile):
                r = rows[start + sl.start:start + sl.stop]
                m = glu(F.linear(r, wg, bg), F.linear(r, wu, bu), spec)
                out[start + sl.start:start + sl.stop] = F.linear(m, wd)
                del r, m  # before the next tile's
            start += n
        ctx.sizes, ctx.tile, ctx.spec = sizes, tile, spec
        ctx.save_for_backward(rows, *experts)
        return out

    @staticmethod
    def backward(ctx, d_out):
        rows, *experts = ctx.saved_tensors
        sizes, tile, spec = ctx.sizes, ctx.tile, ctx.spec
        d_out = d_out.contiguous()
        d_rows = torch.zeros_like(rows)
        most = max((len(token_tiles(n, tile)) for n in sizes), default=1)
        grads = [grad_accumulator(t.numel(), t.dtype, t.device, most).view(t.shape)
                 for t in experts]
        start = 0
        for e, n in enumerate(sizes):
            wg, wu, wd, bg, bu = expert_views(spec, experts, e)
            dwg, dwu, dwd, dbg, dbu = expert_views(spec, grads, e)
            for sl in token_tiles(n, tile):
                rs = slice(start + sl.start, start + sl.stop)
                r, dy = rows[rs], d_out[rs]
                g, u = F.linear(r, wg, bg), F.linear(r, wu, bu)  # recomputed
                dwd += dy.t() @ glu(g, u, spec)
                dg, du = glu_backward(g, u, dy @ wd, spec)
                del g, u
                d_rows[rs] = dg @ wg + du @ wu
                dwg += dg.t() @ r
                dwu += du.t() @ r
                if dbg is not None:
                    dbg += dg.sum(0)
                    dbu += du.sum(0)
                del r, dy, dg, du  # before the next tile's
            start += n
        return (d_rows, None, None, None, *(g.to(t.dtype) for g, t in zip(grads, experts)))


def dispatch_combine(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                     local_experts: Sequence[torch.Tensor], spec: MoESpec,
                     group, tile: int | None = None) -> torch.Tensor:
    """x [N, h] this rank's tokens, their top-k ``weights`` and ``experts`` [N, k];
    ``local_experts`` this rank's experts' tensors in Hugging Face's layout (``gate_up``
    [E/D, 2F, h] and ``down`` [E/D, h, F] for "rows", and so on: :func:`expert_views`), applied
    to their received rows ``tile`` at a time (None: all at once). Returns [N, h]: each token's
    weighted sum of its experts' outputs (with ``weight_input``, Llama 4: the sum of its experts'
    outputs of its weighted copies)."""
    k, per = spec.top_k, spec.local_experts
    order = torch.argsort(experts.reshape(-1), stable=True)  # copies grouped by expert, then token
    tokens = order // k
    splits = _splits(experts, spec, group)
    copies = x[tokens]
    if spec.weight_input:  # Hugging Face scales the routed input in its own dtype
        copies = copies * weights.reshape(-1)[order, None].to(x.dtype)
    rows = comm.all_to_all_rows(copies, group, splits.recv, splits.send)
    del copies
    # received: by source rank, then by local expert; the experts want them by expert
    owner = torch.arange(per, device=x.device).repeat(spec.tsp_size)
    counts = torch.tensor([c for row in splits.received for c in row], device=x.device)
    expert_of_row = torch.repeat_interleave(owner, counts, output_size=rows.shape[0])
    by_expert = torch.argsort(expert_of_row, stable=True)
    grouped = rows[by_expert]
    del rows  # every [k T, h] buffer is dropped as soon as the next one exists
    sizes = splits.per_expert
    outs = _TiledExpertsFn.apply(grouped, sizes, tile or max(sizes, default=1) or 1, spec,
                                 *local_experts)
    del grouped
    out_rows = outs.new_empty(outs.shape).index_copy(0, by_expert, outs)
    del outs
    back = comm.all_to_all_rows(out_rows, group, splits.send, splits.recv)
    del out_rows
    if not spec.weight_input:
        back = back * weights.reshape(-1)[order, None]  # promoted as Hugging Face's product is
    return x.new_zeros(x.shape).index_add(0, tokens, back.to(x.dtype))

"""Schedule "expert" (docs/moe.md (a)): each rank owns E/D whole experts; a token's routed copies
go to their experts' owners by one all-to-all and come back by another (:func:`dispatch_combine`),
the experts running on the rows they received a tile at a time (:func:`_experts_forward`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.distributed_c10d import _resolve_process_group

from ...distributed import comm, opaque
from ..tiles import grad_accumulator, token_tiles
from .experts import expert_views, glu, glu_backward
from .routing import uniform_counts
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
    simulate``), those of uniform routing."""
    D, E, per = spec.tsp_size, spec.num_experts, spec.local_experts
    if is_fake(experts):
        sent, me = uniform_counts(experts.numel(), E), dist.get_rank(group)
        received = [sent[me * per:(me + 1) * per] for _ in range(D)]
    else:
        counts = torch.bincount(experts.reshape(-1), minlength=E)
        got = torch.empty_like(counts)
        comm.all_to_all(got, counts, group)
        sent, received = counts.tolist(), got.view(D, per).tolist()
    return _Splits([sum(sent[r * per:(r + 1) * per]) for r in range(D)],
                   [sum(row) for row in received], received)


def _experts_forward(rows: torch.Tensor, sizes: list[int], tile: int, spec: MoESpec,
                     experts: Sequence[torch.Tensor]) -> torch.Tensor:
    """This rank's experts on the rows they received, grouped by expert (``sizes`` rows each),
    ``tile`` rows at a time: each expert's gate, up and down projections (:func:`expert_views` of
    ``experts``: ``gate_up``, ``down`` and, with expert biases, ``gate_up_bias``, as Hugging Face
    stores them) and its activation (:func:`glu`). Only the rows are kept for the backward
    (:func:`_experts_backward` recomputes a tile's gate, up and activation at a time), so the
    working set is a few [tile, F] tensors, not the intermediates of every received row."""
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
    return out


def _experts_backward(rows: torch.Tensor, d_out: torch.Tensor, sizes: list[int], tile: int,
                      spec: MoESpec, experts: Sequence[torch.Tensor]
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(d_rows, the experts' gradients) of :func:`_experts_forward`."""
    d_out = d_out.contiguous()
    d_rows = torch.zeros_like(rows)
    most = max((len(token_tiles(n, tile)) for n in sizes), default=1)
    grads = [grad_accumulator(t.numel(), t.dtype, t.device, most).view(t.shape) for t in experts]
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
    return d_rows, [g.to(t.dtype) for g, t in zip(grads, experts)]


def _exchange(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]
              ) -> torch.Tensor:
    """Rows of ``x`` sent ``in_splits`` to each rank, received ``out_splits`` from each."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), group, out_splits, in_splits)
    return out


class RoutedExpertsFn(torch.autograd.Function):
    """The middle of :func:`dispatch_combine`: this rank's routed copies of its tokens x [N, h]
    (``order``: the top-k slots grouped by expert, then token; with ``weight_input`` scaled by
    their ``weights`` first) sent to their experts' owners, the experts applied, the outputs
    sent back: [N k, h] in ``order``. How many rows each expert gets, and how many travel to each
    rank, depend on the routing, so under ``torch.compile`` the forward and the backward each run
    as one opaque op (:mod:`tsp_core.distributed.opaque`), with the collectives autograd would
    issue, in its order. Kept for backward: the received rows grouped by expert (the experts
    recompute their activations from them), their order, the split sizes (host tensors), and with
    ``weight_input`` the input and the weights; the combine after it (weights, sum) is plain
    autograd, so what came back is freed before this backward runs."""

    @staticmethod
    def forward(ctx, x, weights, order, experts, spec: MoESpec, group, tile, *local_experts):
        ctx.statics = (spec, group.group_name, tile)  # a name: a process group is no constant
        back, *kept = opaque.run("moe_dispatch_forward", ctx.statics,
                                 [x, weights, order, experts, *local_experts])
        inputs = [x, weights] if spec.weight_input else []
        ctx.save_for_backward(order, *kept, *inputs, *local_experts)
        # returned too: a size fixed by the routing must leave the traced forward as an output
        ctx.mark_non_differentiable(*kept)
        return back, *kept

    @staticmethod
    def backward(ctx, d_back, *_kept):
        spec = ctx.statics[0]
        dx, dw, *grads = opaque.run("moe_dispatch_backward", ctx.statics,
                                    [d_back.contiguous(), *ctx.saved_tensors])
        return (dx, dw if spec.weight_input else None, None, None, None, None, None, *grads)


def _dispatch_forward(statics: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """[back, grouped, by_expert, splits, sizes] (:class:`RoutedExpertsFn`)."""
    spec, group, tile = statics[0], _resolve_process_group(statics[1]), statics[2]
    x, weights, order, experts, *local_experts = tensors
    per = spec.local_experts
    splits = _splits(experts, spec, group)
    copies = x[order // spec.top_k]
    if spec.weight_input:  # Hugging Face scales the routed input in its own dtype
        copies = copies * weights.reshape(-1)[order, None].to(x.dtype)
    rows = _exchange(copies, group, splits.recv, splits.send)
    del copies
    # received: by source rank, then by local expert; the experts want them by expert
    owner = torch.arange(per, device=x.device).repeat(spec.tsp_size)
    counts = torch.tensor([c for row in splits.received for c in row], device=x.device)
    expert_of_row = torch.repeat_interleave(owner, counts, output_size=rows.shape[0])
    by_expert = torch.argsort(expert_of_row, stable=True)
    grouped = rows[by_expert]
    del rows  # every [k T, h] buffer is dropped as soon as the next one exists
    sizes = splits.per_expert
    outs = _experts_forward(grouped, sizes, tile or max(sizes, default=1) or 1, spec,
                            local_experts)
    out_rows = outs.new_empty(outs.shape).index_copy(0, by_expert, outs)
    del outs
    back = _exchange(out_rows, group, splits.send, splits.recv)
    return [back, grouped, by_expert, torch.tensor([splits.send, splits.recv]),
            torch.tensor(sizes)]


def _dispatch_forward_shapes(statics: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    spec = statics[0]
    x, order = tensors[0], tensors[2]
    received = opaque.dynamic_size()
    return [x.new_empty(order.numel(), x.shape[1]), x.new_empty(received, x.shape[1]),
            order.new_empty(received), torch.empty(2, spec.tsp_size, dtype=torch.int64),
            torch.empty(spec.local_experts, dtype=torch.int64)]


def _dispatch_backward(statics: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """[dx, d_weights (None without ``weight_input``), *d_local_experts]
    (:class:`RoutedExpertsFn`)."""
    spec, group, tile = statics[0], _resolve_process_group(statics[1]), statics[2]
    d_back, order, grouped, by_expert, splits, sizes, *rest = tensors
    x, weights = rest[:2] if spec.weight_input else (None, None)
    local_experts = rest[2:] if spec.weight_input else rest
    if is_fake(order):  # tsp simulate: uniform routing
        me, per = dist.get_rank(group), spec.local_experts
        sent = uniform_counts(order.numel(), spec.num_experts)
        send = [sum(sent[r * per:(r + 1) * per]) for r in range(spec.tsp_size)]
        recv = [sum(sent[me * per:(me + 1) * per])] * spec.tsp_size
        sizes = [n * spec.tsp_size for n in sent[me * per:(me + 1) * per]]
    else:
        (send, recv), sizes = splits.tolist(), sizes.tolist()
    d_out = _exchange(d_back, group, recv, send)[by_expert]
    d_grouped, d_local = _experts_backward(grouped, d_out, sizes,
                                           tile or max(sizes, default=1) or 1, spec,
                                           local_experts)
    del d_out
    d_rows = d_grouped.new_empty(d_grouped.shape).index_copy(0, by_expert, d_grouped)
    del d_grouped
    d_copies = _exchange(d_rows, group, send, recv)
    del d_rows
    tokens = order // spec.top_k
    dw = None
    if spec.weight_input:  # the forward's x[tokens] * w.to(x.dtype)
        w = weights.reshape(-1)[order, None]
        d_w = (d_copies * x[tokens]).sum(-1)
        d_copies = d_copies * w.to(x.dtype)
        dw = weights.new_zeros(order.numel()).index_copy(0, order, d_w.to(weights.dtype))
        dw = dw.view(weights.shape)
    n = x.shape[0] if x is not None else order.numel() // spec.top_k
    dx = d_copies.new_zeros(n, d_copies.shape[1]).index_add(0, tokens, d_copies)
    return [dx, dw if dw is not None else dx.new_empty(0), *d_local]


def _dispatch_backward_shapes(statics: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    spec = statics[0]
    d_back, order = tensors[0], tensors[1]
    rest = tensors[6:]
    weights = rest[1] if spec.weight_input else None
    local = rest[2:] if spec.weight_input else rest
    return [d_back.new_empty(order.numel() // spec.top_k, d_back.shape[1]),
            weights.new_empty(weights.shape) if weights is not None else d_back.new_empty(0),
            *(t.new_empty(t.shape) for t in local)]


opaque.opaque("moe_dispatch_forward", _dispatch_forward, _dispatch_forward_shapes)
opaque.opaque("moe_dispatch_backward", _dispatch_backward, _dispatch_backward_shapes)


def dispatch_combine(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                     local_experts: Sequence[torch.Tensor], spec: MoESpec,
                     group, tile: int | None = None) -> torch.Tensor:
    """x [N, h] this rank's tokens, their top-k ``weights`` and ``experts`` [N, k];
    ``local_experts`` this rank's experts' tensors in Hugging Face's layout (``gate_up``
    [E/D, 2F, h] and ``down`` [E/D, h, F] for "rows", and so on: :func:`expert_views`), applied
    to their received rows ``tile`` at a time (None: all at once). Returns [N, h]: each token's
    weighted sum of its experts' outputs (with ``weight_input``, Llama 4: the sum of its experts'
    outputs of its weighted copies)."""
    order = torch.argsort(experts.reshape(-1), stable=True)  # copies grouped by expert, then token
    back = RoutedExpertsFn.apply(x, weights, order, experts, spec, group, tile,
                                 *local_experts)[0]
    if not spec.weight_input:
        back = back * weights.reshape(-1)[order, None]  # promoted as Hugging Face's product is
    return x.new_zeros(x.shape).index_add(0, order // spec.top_k, back.to(x.dtype))

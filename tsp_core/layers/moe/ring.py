"""Schedule "ring" (docs/moe.md (b)): every expert's channels split 1/D; the slices travel around
the TSP ring and every token stays on its rank (:class:`RingExpertsFn`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.distributed_c10d import _resolve_process_group

from ...distributed import comm, opaque
from ...distributed.flat_pack import FlatPack
from ..tiles import grad_accumulator, token_tiles
from .experts import expert_views, glu, glu_backward
from .routing import uniform_counts
from .spec import MoESpec


def _routing(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the top-k slots of ``experts`` [N, k], flat, grouped by expert in token order; how many
    each expert has, a host tensor [E]). Under fake tensors (``tsp simulate``), where routing has
    no values, the counts of uniform routing."""
    order = torch.argsort(experts.reshape(-1), stable=True)
    if is_fake(experts):
        sizes = uniform_counts(experts.numel(), num_experts)
    else:
        sizes = torch.bincount(experts.reshape(-1), minlength=num_experts).tolist()
    return order, torch.tensor(sizes, device="cpu")


def _by_expert(order: torch.Tensor, sizes: torch.Tensor, k: int, num_experts: int
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, top-k slots) routed to each expert, in token order, from :func:`_routing`."""
    if is_fake(order):
        counts = uniform_counts(order.numel(), num_experts)
    else:
        counts = sizes.tolist()
    return list(zip((order // k).split(counts), (order % k).split(counts)))


class RingExpertsFn(torch.autograd.Function):
    """Schedule "ring": every expert's channel slices travel around the TSP ring
    (:func:`comm.ring_over_shards`); each rank applies each slice to its own tokens routed to
    that expert, ``tile`` of them at a time, and adds the weighted partial outputs (with
    ``weight_input``, Llama 4, the partial outputs of the weighted input). The backward
    circulates the slices again, recomputing the activations a tile at a time, with each slice's
    gradient accumulator following it (:func:`comm.ring_over_shards_with_grads`). Kept for
    backward: the input, the routing and this rank's own slices; the working set is a few
    [tile, F/D] tensors (:mod:`.tiles`) and the tile's rows, whatever the number of tokens.
    ``own``: this rank's slices, ``gate, up, down`` ("rows", "columns") or ``gate_up, down[,
    gate_up_bias]`` ("interleaved": a slice of channels is one run of columns). How many tokens
    each expert gets depends on the routing, so under ``torch.compile`` the forward and the
    backward each run as one opaque op (:mod:`tsp_core.distributed.opaque`)."""

    @staticmethod
    def forward(ctx, x, weights, experts, spec: MoESpec, group, tile, *own):
        ctx.statics = (spec, group.group_name, tile)  # a name: a process group is not a constant
        y, order, sizes = opaque.run("moe_ring_forward", ctx.statics, [x, weights, experts, *own])
        ctx.save_for_backward(x, weights, order, sizes, *own)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weights, order, sizes, *own = ctx.saved_tensors
        dx, dw, *grads = opaque.run("moe_ring_backward", ctx.statics,
                                    [x, weights, order, sizes, dy.contiguous(), *own])
        return (dx, dw, None, None, None, None, *grads)


def _ring_forward(statics: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """[y, order, sizes] of :class:`RingExpertsFn`'s forward (the routing kept for backward)."""
    spec, group, tile = statics[0], _resolve_process_group(statics[1]), statics[2]
    x, weights, experts, *own = tensors
    pack = FlatPack([t.shape for t in own])
    split = spec.layout != "interleaved"
    order, sizes = _routing(experts, spec.num_experts)
    routed = _by_expert(order, sizes, experts.shape[1], spec.num_experts)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.zeros(x.shape, dtype=acc, device=x.device)

    def compute(_owner: int, shard: torch.Tensor) -> None:
        slices = pack.unpack(shard)
        for e, (tokens, slots) in enumerate(routed):
            wg, wu, wd, bg, bu = expert_views(spec, slices, e, split)
            for sl in token_tiles(len(tokens), tile):
                tok, slot = tokens[sl], slots[sl]
                w = weights[tok, slot, None]
                xe = x[tok] * w.to(x.dtype) if spec.weight_input else x[tok]
                out = F.linear(glu(F.linear(xe, wg, bg), F.linear(xe, wu, bu), spec), wd)
                y.index_add_(0, tok, out.to(acc) if spec.weight_input else out.to(acc) * w)
                del xe, out  # before the next tile's

    comm.ring_over_shards(pack.pack(list(own)), group, compute)
    return [y.to(x.dtype), order, sizes]


def _ring_forward_shapes(statics: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    spec = statics[0]
    x, _, experts = tensors[:3]
    return [x.new_empty(x.shape), experts.new_empty(experts.numel()),
            torch.empty(spec.num_experts, dtype=torch.int64, device="cpu")]


def _ring_backward(statics: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """[dx, d_weights, *d_own] of :class:`RingExpertsFn`'s backward."""
    spec, group, tile = statics[0], _resolve_process_group(statics[1]), statics[2]
    x, weights, order, sizes, dy, *own = tensors
    pack = FlatPack([t.shape for t in own])
    split = spec.layout != "interleaved"
    routed = _by_expert(order, sizes, weights.shape[1], spec.num_experts)
    dx = torch.zeros_like(x)
    # the routing weights' gradient is a sum over the slices: summed wide, cast once (the
    # weights are float32 even for a bf16 or float64 model, Mixtral)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    dw = torch.zeros(weights.shape, dtype=acc, device=x.device)
    most = max((len(token_tiles(len(tokens), tile)) for tokens, _ in routed), default=1)

    def contribute(_owner: int, shard: torch.Tensor) -> torch.Tensor:
        slices = pack.unpack(shard)
        grads = grad_accumulator(shard.numel(), shard.dtype, shard.device, most)
        grad_slices = pack.unpack(grads)
        for e, (tokens, slots) in enumerate(routed):
            wg, wu, wd, bg, bu = expert_views(spec, slices, e, split)
            dwg, dwu, dwd, dbg, dbu = expert_views(spec, grad_slices, e, split)
            for sl in token_tiles(len(tokens), tile):
                tok, slot = tokens[sl], slots[sl]
                w, dye = weights[tok, slot, None], dy[tok]
                xe = x[tok] * w.to(x.dtype) if spec.weight_input else x[tok]
                g, u = F.linear(xe, wg, bg), F.linear(xe, wu, bu)  # recomputed
                m = glu(g, u, spec)
                if spec.weight_input:
                    dpart = dye
                else:
                    dw.index_put_((tok, slot), (F.linear(m, wd) * dye).sum(-1).to(acc),
                                  accumulate=True)
                    dpart = (dye * w).to(x.dtype)
                dwd += dpart.t() @ m
                del m
                dg, du = glu_backward(g, u, dpart @ wd, spec)
                del g, u
                dxe = dg @ wg + du @ wu
                if spec.weight_input:
                    dw.index_put_((tok, slot), (dxe * x[tok]).sum(-1).to(acc), accumulate=True)
                    dx.index_add_(0, tok, dxe * w.to(x.dtype))
                else:
                    dx.index_add_(0, tok, dxe)
                dwg += dg.t() @ xe
                dwu += du.t() @ xe
                if dbg is not None:
                    dbg += dg.sum(0)
                    dbu += du.sum(0)
                del xe, dye, dpart, dg, du, dxe  # before the next tile's
        return grads.to(shard.dtype)

    grad = comm.ring_over_shards_with_grads(pack.pack(own), group, contribute)
    return [dx, dw.to(weights.dtype), *pack.unpack(grad)]


def _ring_backward_shapes(statics: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    x, weights, own = tensors[0], tensors[1], tensors[5:]
    return [x.new_empty(x.shape), weights.new_empty(weights.shape),
            *(t.new_empty(t.shape) for t in own)]


opaque.opaque("moe_ring_forward", _ring_forward, _ring_forward_shapes)
opaque.opaque("moe_ring_backward", _ring_backward, _ring_backward_shapes)

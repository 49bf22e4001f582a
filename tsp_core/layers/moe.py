"""Mixture-of-experts MLP with the experts folded onto the TSP axis (docs/design.md
"Mixture-of-experts MLP", docs/moe.md (a)): rank p owns experts [p*E/D, (p+1)*E/D) whole; the router
is replicated and each rank routes its own tokens. A token's k routed copies travel to their
experts' owners by one all-to-all (dropless: variable splits, exchanged first) and the expert
outputs come back by a second one; the token's owner weights and sums them. The backward runs the
two all-to-alls the other way (autograd over :func:`tsp_core.comm.all_to_all_rows`).

Routing follows the Hugging Face family exactly (``MoESpec``): softmax of the router logits in
float32, top-k, the top-k weights renormalised (Mixtral always, Qwen3-MoE with
``norm_topk_prob``) and, for Qwen3-MoE, cast back to the logits' dtype. Each call keeps its
router logits (``router_logits``, local tokens only) for the load-balancing loss, which
:func:`load_balancing_loss` computes over the global batch as one process does.

Two schedules (docs/moe.md), chosen per layer at construction (``schedule``): "expert" above
(E/D whole experts per rank, routed copies move: about 4 T k h b (D-1)/D bytes per rank per
step for T local tokens) and "ring": every expert's intermediate channels split 1/D (gate, up and
down of channels [pF/D, (p+1)F/D) of every expert), the slices of all experts circulating as in
:class:`tsp_core.layers.mlp.TSPGatedMLP` while every token stays on its rank (3 E F h b (3D-2)/D
bytes per step, whatever T). :func:`choose_schedule` picks the one that moves fewer bytes for a
given T (the traffic model's formula); they cross at about T* = 9 E F / (4 k).

What the backward keeps under "expert": this rank's expert weights, the router logits of its own
tokens and, as autograd saves them, the rows its experts received (about k times its own token
count when routing is balanced) and the combined outputs (the experts' activations are
recomputed, :class:`_TiledExpertsFn`); under "ring": its own
slices, its tokens and their routing (activations recomputed per slice, as the dense MLP). Under
``FakeTensorMode`` (``tsp simulate``), where routing has no values, the splits are those of uniform
routing.

At long context (docs/moe.md "At long context"): both schedules run the experts ``tile_tokens``
rows at a time (:mod:`.tiles`), recomputing a tile's activations in the backward, so no expert's
[rows, F] intermediate exists beyond a tile. Under "ring" nothing else grows with the tokens but
the input and the routing; under "expert" the routed copies do: the received rows and the
combined outputs [k T, h] are kept for backward, and the dispatch and combine hold up to two
more [k T, h] buffers while they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from ..distributed import comm
from ..distributed.flat_pack import FlatPack
from ..distributed.mesh import TSPMesh
from ..distributed.params import (
    REPLICATED,
    ShardedModule,
    ShardSpec,
    TensorSource,
    even_spec,
    init_full,
    local,
    schedule_inputs,
)
from .mlp import ACTIVATIONS, MLPSpec, _act, _act_grad, _TSPGatedMLPFn, check_local_input
from .sizes import valid_sizes_hint, valid_tsp_sizes
from .tiles import TokenTiled, grad_accumulator, mlp_tile_tokens, token_tiles


@dataclass(frozen=True)
class MoESpec:
    hidden_size: int
    intermediate_size: int   # per expert
    num_experts: int
    top_k: int
    tsp_size: int
    activation: str = "silu"
    norm_topk: bool = True              # renormalise the top-k weights to sum to one
    weights_in_logits_dtype: bool = False  # cast them back to the logits' dtype (Qwen3-MoE)
    # the router kind (ROUTERS) and its parameters; "sigmoid": GLM-4.5's (DeepSeek-V3's) router
    router: str = "softmax"
    routed_scaling: float = 1.0         # the top-k weights times this (routed_scaling_factor)
    n_group: int = 1                    # "sigmoid": experts in n_group groups, the top-k taken
    topk_group: int = 1                 # ... among the topk_group best groups only
    correction_bias: bool = False       # "sigmoid": a buffer added to the scores for the choice
    # a dense gated MLP beside the routed experts on every token (0: none), its module's name
    shared_intermediate_size: int = 0
    shared_name: str = "shared_experts"

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.tsp_size

    def options(self) -> dict:
        """The keyword arguments of :class:`TSPMoE` beyond the shapes: how it routes and what
        runs beside the experts (``parallelize`` builds the layers with them)."""
        return dict(activation=self.activation, norm_topk=self.norm_topk,
                    weights_in_logits_dtype=self.weights_in_logits_dtype, router=self.router,
                    routed_scaling=self.routed_scaling, n_group=self.n_group,
                    topk_group=self.topk_group, correction_bias=self.correction_bias,
                    shared_intermediate_size=self.shared_intermediate_size,
                    shared_name=self.shared_name)


ROUTERS = ("softmax", "sigmoid")


def check_router(spec: MoESpec) -> None:
    """Raise, naming the numbers, when the router's options cannot route (before any
    collective): an unknown kind, groups that do not divide the experts, too few experts in the
    chosen groups for the top-k."""
    E, k, g, tg = spec.num_experts, spec.top_k, spec.n_group, spec.topk_group
    if spec.router not in ROUTERS:
        raise ValueError(f"router {spec.router!r} is not one of {ROUTERS}")
    if spec.router == "softmax" and (g != 1 or tg != 1 or spec.correction_bias):
        raise ValueError(f"n_group ({g}), topk_group ({tg}) and the correction bias "
                         f"({spec.correction_bias}) belong to the \"sigmoid\" router; the softmax "
                         f"router takes n_group=1, topk_group=1, correction_bias=False")
    if g < 1 or E % g:
        raise ValueError(f"n_group ({g}) must divide the number of experts ({E})")
    if g > 1 and E // g < 2:
        raise ValueError(f"n_group ({g}) leaves {E // g} expert per group; a group's score is "
                         f"the sum of its best two: use n_group <= {E // 2}")
    if not 1 <= tg <= g or k > tg * (E // g):
        raise ValueError(f"topk_group ({tg}) must be between 1 and n_group ({g}) and its groups "
                         f"must hold the top {k} ({tg} x {E // g} experts)")


def check_moe_shape(tsp_size: int, num_experts: int, top_k: int,
                    schedule: str = "expert", valid: Sequence[int] | None = None) -> None:
    """Raise, naming the numbers and the sizes that would work, when the routing is impossible
    or (schedule "expert") the experts cannot be owned whole, 1/D each. ``valid``: the whole
    model's valid sizes (``parallelize`` passes them), else those of the experts."""
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of "
                         f"experts ({num_experts})")
    if schedule == "expert" and num_experts % tsp_size:
        hint = (valid_sizes_hint(valid) if valid is not None else
                valid_sizes_hint(valid_tsp_sizes(None, None, num_experts),
                                 f"{num_experts} experts"))
        raise ValueError(f"tsp_size ({tsp_size}) must divide the number of experts "
                         f"({num_experts}): each rank owns E/D whole experts (uneven ownership "
                         f"would break the 1/D memory rule); {hint}; or moe_schedule=\"ring\" "
                         f"(every expert's channels split instead)")


def recomputing() -> bool:
    """Whether autograd's engine is running a backward on this thread: a forward called now is an
    activation checkpoint's recompute, whose router logits must not be kept (they would hold
    the recomputed graph, saved rows and expert activations included, past the step)."""
    return torch._C._current_graph_task_id() != -1


def router_logits(x: torch.Tensor, weight: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """Router logits [N, E] of tokens x [N, h]: in the input's dtype for the softmax router; in
    float32 at least for the sigmoid one (GLM-4.5 casts the input and the weight to float32;
    a float64 model stays float64)."""
    if spec.router == "sigmoid":
        wide = torch.promote_types(x.dtype, torch.float32)
        return F.linear(x.to(wide), weight.to(wide))
    return F.linear(x, weight)


def route(logits: torch.Tensor, spec: MoESpec, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, expert indices) [N, k] of router logits [N, E], Hugging Face's numerics.
    "softmax" (Mixtral, Qwen3-MoE): softmax in float32, top-k, renormalised, and cast back for
    Qwen3-MoE. "sigmoid" (GLM-4.5): scores sigmoid(logits); the choice ranks scores + ``bias``
    (the correction bias: it moves which experts are chosen, never their weights), first the
    ``topk_group`` groups whose best two sum highest, then the top-k inside them; the weights
    are the chosen experts' scores, renormalised (``norm_topk``). Both: times
    ``routed_scaling``."""
    if spec.router == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = logits.sigmoid()
        choice = scores if bias is None else scores + bias
        if spec.n_group > 1:
            groups = choice.view(-1, spec.n_group, spec.num_experts // spec.n_group)
            best = torch.topk(groups.topk(2, dim=-1)[0].sum(-1), spec.topk_group, dim=-1)[1]
            kept = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~kept[..., None], float("-inf")).flatten(1)
        experts = torch.topk(choice, spec.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if spec.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.routed_scaling != 1.0:
        weights = weights * spec.routed_scaling
    if spec.weights_in_logits_dtype:
        weights = weights.to(logits.dtype)
    return weights, experts


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
    ``tile`` rows at a time: each expert's ``gate_up`` [2F, h] and ``down`` [h, F] as Hugging
    Face's eager experts apply them. The backward recomputes a tile's gate, up and activation
    at a time, so only the rows are kept and the working set is a few [tile, F] tensors, not the
    intermediates of every received row."""

    @staticmethod
    def forward(ctx, rows, sizes: list[int], tile: int, activation: str, gate_up, down):
        out = rows.new_empty(rows.shape)
        start = 0
        for e, n in enumerate(sizes):
            for sl in token_tiles(n, tile):
                r = rows[start + sl.start:start + sl.stop]
                gate, up = F.linear(r, gate_up[e]).chunk(2, dim=-1)
                out[start + sl.start:start + sl.stop] = F.linear(_act(gate, activation) * up,
                                                                 down[e])
                del r, gate, up  # before the next tile's
            start += n
        ctx.sizes, ctx.tile, ctx.activation = sizes, tile, activation
        ctx.save_for_backward(rows, gate_up, down)
        return out

    @staticmethod
    def backward(ctx, d_out):
        rows, gate_up, down = ctx.saved_tensors
        sizes, tile, activation = ctx.sizes, ctx.tile, ctx.activation
        d_out = d_out.contiguous()
        d_rows = torch.zeros_like(rows)
        most = max((len(token_tiles(n, tile)) for n in sizes), default=1)
        d_gate_up = grad_accumulator(gate_up.numel(), gate_up.dtype, gate_up.device,
                                     most).view(gate_up.shape)
        d_down = grad_accumulator(down.numel(), down.dtype, down.device, most).view(down.shape)
        f = down.shape[-1]
        start = 0
        for e, n in enumerate(sizes):
            for sl in token_tiles(n, tile):
                rs = slice(start + sl.start, start + sl.stop)
                r, dy = rows[rs], d_out[rs]
                gate, up = F.linear(r, gate_up[e]).chunk(2, dim=-1)  # recomputed
                a = _act(gate, activation)
                d_down[e] += dy.t() @ (a * up)
                dm = dy @ down[e]
                du = dm * a
                del a
                dg = dm.mul_(up).mul_(_act_grad(gate, activation))
                del gate, up
                d_rows[rs] = dg @ gate_up[e, :f] + du @ gate_up[e, f:]
                d_gate_up[e, :f] += dg.t() @ r
                d_gate_up[e, f:] += du.t() @ r
                del r, dy, dm, du, dg  # before the next tile's
            start += n
        return (d_rows, None, None, None, d_gate_up.to(gate_up.dtype), d_down.to(down.dtype))


def dispatch_combine(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor, spec: MoESpec,
                     group, tile: int | None = None) -> torch.Tensor:
    """x [N, h] this rank's tokens, their top-k ``weights`` and ``experts`` [N, k]; ``gate_up``
    [E/D, 2F, h] and ``down`` [E/D, h, F] this rank's experts, applied to their received rows
    ``tile`` at a time (None: all at once). Returns [N, h]: each token's weighted sum of its
    experts' outputs."""
    k, per = spec.top_k, spec.local_experts
    order = torch.argsort(experts.reshape(-1), stable=True)  # copies grouped by expert, then token
    tokens = order // k
    splits = _splits(experts, spec, group)
    rows = comm.all_to_all_rows(x[tokens], group, splits.recv, splits.send)
    # received: by source rank, then by local expert; the experts want them by expert
    owner = torch.arange(per, device=x.device).repeat(spec.tsp_size)
    counts = torch.tensor([c for row in splits.received for c in row], device=x.device)
    expert_of_row = torch.repeat_interleave(owner, counts, output_size=rows.shape[0])
    by_expert = torch.argsort(expert_of_row, stable=True)
    grouped = rows[by_expert]
    del rows  # every [k T, h] buffer is dropped as soon as the next one exists
    sizes = splits.per_expert
    outs = _TiledExpertsFn.apply(grouped, sizes, tile or max(sizes, default=1) or 1,
                                 spec.activation, gate_up, down)
    del grouped
    out_rows = outs.new_empty(outs.shape).index_copy(0, by_expert, outs)
    del outs
    back = comm.all_to_all_rows(out_rows, group, splits.send, splits.recv)
    del out_rows
    weighted = back * weights.reshape(-1)[order, None]  # promoted as Hugging Face's product is
    del back
    return x.new_zeros(x.shape).index_add(0, tokens, weighted.to(x.dtype))


@dataclass(frozen=True)
class MoEScheduleBytes:
    """Bytes one rank sends in one MoE layer under the two TSP schedules of ``docs/moe.md``."""

    a_forward: float   # (a) expert parallel: dispatch + combine (+ the counts)
    a_backward: float  # their gradients + the router's gradient all-reduce
    b_forward: float   # (b) the ring: every rank's slice of every expert travels D-1 hops
    b_backward: float  # the slices again (D-1 hops) + the gradient accumulators (D hops) + router
    crossover: float   # tokens per rank at which (a) and (b) move the same bytes
    forward_passes: int = 1

    @property
    def a(self) -> float:
        return self.forward_passes * self.a_forward + self.a_backward

    @property
    def b(self) -> float:
        return self.forward_passes * self.b_forward + self.b_backward

    @property
    def choice(self) -> str:
        """"a" or "b": the schedule that moves fewer bytes (ties: "a", the default)."""
        return "a" if self.a <= self.b else "b"


def moe_bytes(E: int, k: int, Fe: int, h: int, tokens_per_rank: float, d: int, b: int = 2,
              forward_passes: int = 1, shared: int = 0) -> MoEScheduleBytes:
    """:func:`tsp_core.plan.traffic.moe_schedule_bytes` of E experts of Fe channels, top k, hidden h
    (what :func:`choose_schedule` decides with). ``shared``: the shared experts' intermediate
    size; they run as the dense TSP MLP under both schedules (their channel slices travel, no
    token moves: 3 Fs h b (D-1)/D forward, (2D-1)/D of it backward), so they add the same bytes
    to both and leave the crossover where it is."""
    f = (d - 1) / d
    per_token = f * 2 * k * h * b                   # one all-to-all pair per token, one pass
    router = f * 2 * E * h * b
    dense = 3 * shared * h * b                      # the shared experts' weights
    a_fw = per_token * tokens_per_rank + f * 8 * E + f * dense
    a_bw = per_token * tokens_per_rank + router + (f + 1) * dense
    ring = 3 * E * Fe * h * b
    b_fw, b_bw = f * (ring + dense), (f + 1) * (ring + dense) + router
    if f == 0:
        crossover = float("inf")
    else:  # forward_passes * (a_fw - b_fw) + a_bw - b_bw = 0, linear in T
        crossover = (forward_passes * (f * ring - f * 8 * E) + (f + 1) * ring) / \
            ((forward_passes + 1) * per_token)   # the shared experts' bytes cancel
    return MoEScheduleBytes(a_fw, a_bw, b_fw, b_bw, crossover, forward_passes)


SCHEDULES = ("expert", "ring")


def choose_schedule(spec: MoESpec, tokens_per_rank: int | None, forward_passes: int = 1) -> str:
    """The schedule that moves fewer bytes per layer for ``tokens_per_rank`` (batch x sequence
    / D), by the traffic model's formula (:func:`moe_bytes`, docs/moe.md;
    ``forward_passes`` 2 under full recompute); "expert" when it is not known. They cross at
    about T* = 9 E F / (4 k) tokens per rank (at D = 8: Mixtral-8x7B 135168, Qwen3-30B-A3B 28965:
    "expert" at the lengths people train Mixtral at, "ring" for Qwen3-30B-A3B beyond ~232K
    tokens at D = 8)."""
    if tokens_per_rank is None:
        return "expert"
    bytes_ = moe_bytes(spec.num_experts, spec.top_k, spec.intermediate_size, spec.hidden_size,
                       tokens_per_rank, spec.tsp_size, forward_passes=forward_passes,
                       shared=spec.shared_intermediate_size)
    return "expert" if bytes_.choice == "a" else "ring"


def _by_expert(experts: torch.Tensor, num_experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, top-k slots) routed to each expert, in token order."""
    flat = torch.arange(experts.numel(), device=experts.device)
    token, slot = flat // experts.shape[1], flat % experts.shape[1]
    order = torch.argsort(experts.reshape(-1), stable=True)
    if is_fake(experts):  # tsp simulate: uniform routing
        n = experts.numel()
        sizes = [n // num_experts + (e < n % num_experts) for e in range(num_experts)]
    else:
        sizes = torch.bincount(experts.reshape(-1), minlength=num_experts).tolist()
    return list(zip(token[order].split(sizes), slot[order].split(sizes)))


class _RingExpertsFn(torch.autograd.Function):
    """Schedule "ring": every expert's channel slices travel around the TSP ring
    (:func:`comm.ring_over_shards`); each rank applies each slice to its own tokens routed to
    that expert, ``tile`` of them at a time, and adds the weighted partial outputs. The backward
    circulates the slices again, recomputing the activations a tile at a time, with each slice's
    gradient accumulator following it (:func:`comm.ring_over_shards_with_grads`). Kept for
    backward: the input, the routing and this rank's own slices; the working set is a few
    [tile, F/D] tensors (:mod:`.tiles`) and the tile's rows, whatever the number of tokens."""

    @staticmethod
    def forward(ctx, x, weights, experts, spec: MoESpec, group, tile, gate, up, down):
        pack = FlatPack([gate.shape, up.shape, down.shape])
        routed = _by_expert(experts, spec.num_experts)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = torch.zeros(x.shape, dtype=acc, device=x.device)

        def compute(_owner: int, shard: torch.Tensor) -> None:
            wg, wu, wd = pack.unpack(shard)
            for e, (tokens, slots) in enumerate(routed):
                for sl in token_tiles(len(tokens), tile):
                    tok, slot = tokens[sl], slots[sl]
                    xe = x[tok]
                    m = _act(F.linear(xe, wg[e]), spec.activation) * F.linear(xe, wu[e])
                    y.index_add_(0, tok, F.linear(m, wd[e]).to(acc) * weights[tok, slot, None])
                    del xe, m  # before the next tile's

        comm.ring_over_shards(pack.pack([gate, up, down]), group, compute)
        ctx.spec, ctx.group, ctx.pack, ctx.routed, ctx.tile = spec, group, pack, routed, tile
        ctx.save_for_backward(x, weights, gate, up, down)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        spec, pack, routed, tile = ctx.spec, ctx.pack, ctx.routed, ctx.tile
        x, weights, *own = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.zeros_like(x)
        # the routing weights' gradient is a sum over the slices: summed wide, cast once (the
        # weights are float32 even for a bf16 or float64 model, Mixtral)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        dw = torch.zeros(weights.shape, dtype=acc, device=x.device)
        most = max((len(token_tiles(len(tokens), tile)) for tokens, _ in routed), default=1)

        def contribute(_owner: int, shard: torch.Tensor) -> torch.Tensor:
            wg, wu, wd = pack.unpack(shard)
            grads = grad_accumulator(shard.numel(), shard.dtype, shard.device, most)
            gg, gu, gd = pack.unpack(grads)
            for e, (tokens, slots) in enumerate(routed):
                for sl in token_tiles(len(tokens), tile):
                    tok, slot = tokens[sl], slots[sl]
                    xe, dye = x[tok], dy[tok]
                    g, u = F.linear(xe, wg[e]), F.linear(xe, wu[e])  # recomputed
                    a = _act(g, spec.activation)
                    m = a * u
                    dw.index_put_((tok, slot), (F.linear(m, wd[e]) * dye).sum(-1).to(acc),
                                  accumulate=True)
                    dpart = (dye * weights[tok, slot, None]).to(x.dtype)
                    dm = dpart @ wd[e]
                    gd[e] += dpart.t() @ m
                    del m
                    du = dm * a
                    del a
                    dg = dm.mul_(u)
                    del u
                    dg.mul_(_act_grad(g, spec.activation))
                    del g
                    dx.index_add_(0, tok, dg @ wg[e] + du @ wu[e])
                    gg[e] += dg.t() @ xe
                    gu[e] += du.t() @ xe
                    del xe, dye, dpart, dm, dg, du  # before the next tile's
            return grads.to(shard.dtype)

        grad = comm.ring_over_shards_with_grads(pack.pack(own), ctx.group, contribute)
        return (dx, dw.to(weights.dtype), None, None, None, None, *pack.unpack(grad))


class TSPMoE(TokenTiled, ShardedModule):
    """A sparse mixture-of-experts block with Hugging Face's names and shapes: the router
    ``gate.weight`` [E, h] (replicated), ``experts.gate_up_proj`` [E, 2F, h] (gate rows, then up
    rows) and ``experts.down_proj`` [E, h, F]. ``schedule`` "expert": split by whole experts over
    the TSP group; "ring": every expert split by intermediate channels (kept as
    ``experts.gate_proj`` and ``experts.up_proj`` [E, F, h], named and loaded as the fused
    ``gate_up_proj`` in every full state dict and checkpoint). ``forward(x)`` takes this rank's
    tokens [B, S/D, h]."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, intermediate_size: int, num_experts: int,
                 top_k: int, *, activation: str = "silu", norm_topk: bool = True,
                 weights_in_logits_dtype: bool = False, router: str = "softmax",
                 routed_scaling: float = 1.0, n_group: int = 1, topk_group: int = 1,
                 correction_bias: bool = False, shared_intermediate_size: int = 0,
                 shared_name: str = "shared_experts", schedule: str = "expert",
                 dtype: torch.dtype | None = None, router_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_seed: int | None = 0,
                 tile_tokens: int | None = None) -> None:
        super().__init__()
        self.tile_tokens = tile_tokens
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
        check_moe_shape(mesh.size, num_experts, top_k, schedule)
        if schedule == "ring" and intermediate_size % mesh.size:
            hint = valid_sizes_hint(valid_tsp_sizes(None, None, intermediate_size),
                                    f"the experts' intermediate size {intermediate_size}")
            raise ValueError(f"tsp_size ({mesh.size}) must divide the experts' intermediate size "
                             f"({intermediate_size}) under the ring schedule; {hint}")
        fs = shared_intermediate_size
        if fs % mesh.size:
            hint = valid_sizes_hint(valid_tsp_sizes(None, None, fs),
                                    f"the shared experts' intermediate size {fs}")
            raise ValueError(f"tsp_size ({mesh.size}) must divide the shared experts' "
                             f"intermediate size ({fs}): they run as the dense TSP MLP; {hint}")
        self.mesh, self.schedule = mesh, schedule
        self.spec = MoESpec(hidden_size, intermediate_size, num_experts, top_k, mesh.size,
                            activation, norm_topk, weights_in_logits_dtype, router,
                            routed_scaling, n_group, topk_group, correction_bias, fs, shared_name)
        check_router(self.spec)
        h, f, e = hidden_size, intermediate_size, num_experts
        if schedule == "expert":
            self.names = ("gate.weight", "experts.gate_up_proj", "experts.down_proj")
            self.full_shapes = {"gate.weight": (e, h), "experts.gate_up_proj": (e, 2 * f, h),
                                "experts.down_proj": (e, h, f)}
        else:
            self.names = ("gate.weight", "experts.gate_proj", "experts.up_proj",
                          "experts.down_proj")
            self.full_shapes = {"gate.weight": (e, h), "experts.gate_proj": (e, f, h),
                                "experts.up_proj": (e, f, h), "experts.down_proj": (e, h, f)}
        # the shared experts: TSPGatedMLP's parameters and schedule, on this rank's own tokens
        self.shared = tuple(f"{shared_name}.{p}_proj.weight" for p in ("gate", "up", "down"))
        if fs:
            self.names += self.shared
            self.full_shapes.update({self.shared[0]: (fs, h), self.shared[1]: (fs, h),
                                     self.shared[2]: (h, fs)})
        self.router_logits: torch.Tensor | None = None
        full = init_full(self.full_shapes, init_seed, dtype, device)
        if router_dtype is not None:  # GLM-4.5's router weight stays float32 in a bf16 model
            full["gate.weight"] = full["gate.weight"].to(router_dtype)
        self._create(full)
        if schedule == "ring":
            self.fuse_tensors("experts.gate_up_proj", ("experts.gate_proj", "experts.up_proj"), 1)
        if correction_bias:  # a buffer (not trained), float32 at least, as Hugging Face keeps it
            wide = torch.promote_types(dtype or torch.get_default_dtype(), torch.float32)
            self.gate.register_buffer("e_score_correction_bias",
                                      torch.zeros(e, dtype=wide, device=device))

    def load_full(self, full) -> None:
        """The parameters' slices, and the correction bias whole where ``full`` has it (a
        checkpoint may leave a buffer out: it keeps its value)."""
        super().load_full(full)
        name = "gate.e_score_correction_bias"
        if self.spec.correction_bias:
            source = TensorSource(full) if isinstance(full, Mapping) else full
            if source.shape(name) is not None:
                with torch.no_grad():
                    self.gate.e_score_correction_bias.copy_(source.read(name, None, 0, 0))

    def _route(self, x2: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(logits, top-k weights, experts) of tokens x2 [N, h] with router weight ``router``."""
        logits = router_logits(x2, router, self.spec)
        bias = self.gate.e_score_correction_bias if self.spec.correction_bias else None
        return (logits, *route(logits, self.spec, bias))

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden_size={s.hidden_size}, intermediate_size={s.intermediate_size}, "
                f"experts={s.num_experts}, top_k={s.top_k}, tsp_size={s.tsp_size}, "
                f"schedule={self.schedule}, router={s.router}"
                + (f", shared={s.shared_intermediate_size}" if s.shared_intermediate_size else ""))

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        s = self.spec
        if name == "gate.weight":
            return REPLICATED
        if name in self.shared:  # the dense TSP MLP's slices of intermediate channels
            return even_spec(s.shared_intermediate_size, rank, s.tsp_size,
                             1 if name == self.shared[2] else 0)
        if self.schedule == "expert":
            return even_spec(s.num_experts, rank, s.tsp_size, 0)
        dim = 2 if name == "experts.down_proj" else 1
        return even_spec(s.intermediate_size, rank, s.tsp_size, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tsp_decode is not None:  # generation: x identical on every rank
            return self.tsp_decode.mlp(self, x)
        s = self.spec
        check_local_input(x, s.hidden_size)
        x, experts_weights, context = schedule_inputs(self, list(self.names[1:]), x)
        shared = experts_weights[len(experts_weights) - 3:] if s.shared_intermediate_size else []
        experts_weights = experts_weights[:len(experts_weights) - len(shared)]
        router = local(self.gate.weight)  # in its own dtype: the sigmoid router widens it
        if s.router == "softmax":  # the input's dtype (autocast's, as the other weights)
            router = router.to(x.dtype)
        with context:
            x2 = x.reshape(-1, s.hidden_size)
            logits, weights, experts = self._route(x2, comm.sum_grad(router, self.mesh.group))
            if not recomputing():  # the load-balancing loss reads the forward's, not a recompute's
                self.router_logits = logits
            if self.schedule == "expert":
                # a tile's gate and up are one [tile, 2F] product: count 2F channels
                tile = self.tile_tokens or mlp_tile_tokens(2 * s.intermediate_size, x.dtype)
                y = dispatch_combine(x2, weights, experts, *experts_weights, s, self.mesh.group,
                                     tile)
            else:
                tile = self.tile_tokens or mlp_tile_tokens(s.intermediate_size // s.tsp_size,
                                                           x.dtype)
                y = _RingExpertsFn.apply(x2, weights, experts, s, self.mesh.group, tile,
                                         *experts_weights)
            y = y.view(x.shape)
            if shared:  # Hugging Face adds them after the routed experts' sum
                spec = MLPSpec(s.hidden_size, s.shared_intermediate_size, s.tsp_size,
                               s.activation)
                tile = self.tile_tokens or mlp_tile_tokens(
                    s.shared_intermediate_size // s.tsp_size, x.dtype)
                y = y + _TSPGatedMLPFn.apply(x, spec, self.mesh.group, tile, *shared)
        return y

    def decode_step(self, x: torch.Tensor) -> torch.Tensor:
        """Generation: ``x`` [..., h] identical on every rank; each rank adds what it holds (its
        own experts, or its channels of every expert) for each token's experts, weighted; an
        all-reduce sums them. No token or weight moves."""
        s = self.spec
        x2 = x.reshape(-1, s.hidden_size)
        _, weights, experts = self._route(x2, local(self.gate.weight))
        w = {n: local(p) for n, p in self.named_parameters()}
        if self.schedule == "expert":
            first, owned = self.mesh.rank * s.local_experts, range(s.local_experts)
            gate, up = w["experts.gate_up_proj"].chunk(2, dim=1)
        else:
            first, owned = 0, range(s.num_experts)
            gate, up = w["experts.gate_proj"], w["experts.up_proj"]
        down = w["experts.down_proj"]
        y = torch.zeros_like(x2)
        for e in owned:
            token, slot = torch.where(experts == first + e)
            if token.numel():
                xe = x2[token]
                m = _act(F.linear(xe, gate[e]), s.activation) * F.linear(xe, up[e])
                y.index_add_(0, token, (F.linear(m, down[e]) * weights[token, slot, None])
                             .to(y.dtype))
        if s.shared_intermediate_size:  # this rank's channels of the shared experts: summed
            wg, wu, wd = (w[n] for n in self.shared)  # apart, added after, as Hugging Face does
            shared = (_act(F.linear(x2, wg), s.activation) * F.linear(x2, wu)) @ wd.t()
            both = torch.stack([y, shared])
            comm.all_reduce(both, self.mesh.group)  # one all-reduce for both
            return (both[0] + both[1]).view(x.shape)
        comm.all_reduce(y, self.mesh.group)
        return y.view(x.shape)


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        groups: Sequence[dist.ProcessGroup],
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Hugging Face's ``load_balancing_loss_func`` over the global batch: E * sum_e f_e P_e, f_e
    the fraction of routed copies (top-k of the softmax) that went to expert e and P_e the mean
    router probability of e, both over every non-padding token of every layer of every rank.

    ``router_logits``: every MoE layer's logits of the tokens this rank routed (its own tokens
    under TSP); ``attention_mask``: those tokens' mask (padding counts nowhere); ``groups``: the
    mesh dims over which ranks routed different tokens. The counts are summed there without
    gradient, the probability sums with :func:`comm.sum_over`, so each rank's backward reaches
    its own tokens' router logits (ranks that routed the same tokens, tensor parallel, compute
    the same loss). Computed in float32, or float64 for float64 logits (one process in float64
    is the reference; Hugging Face's own sums run in float32)."""
    first = router_logits[0]
    dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
    w = (torch.ones(first.shape[0], dtype=dtype, device=first.device) if attention_mask is None
         else attention_mask.reshape(-1).to(dtype))
    counts = torch.zeros(num_experts, dtype=dtype, device=first.device)
    prob_sums = torch.zeros(num_experts, dtype=dtype, device=first.device)
    for logits in router_logits:
        probs = torch.softmax(logits.to(dtype), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = counts.index_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob_sums = prob_sums + (probs * w[:, None]).sum(0)
    totals = torch.cat([counts, (w.sum() * len(router_logits)).reshape(1)]).detach()
    for group in groups:
        comm.all_reduce(totals, group)
    counts, rows = totals[:-1], totals[-1]
    prob_sums = comm.sum_over(prob_sums, groups)
    return (counts / rows * (prob_sums / rows)).sum() * num_experts

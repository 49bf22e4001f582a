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

from dataclasses import dataclass, fields
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
    activation: str = "silu"  # ACTIVATIONS, or "swiglu_clamped" (gpt-oss: swiglu_limit, _alpha)
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
    router_name: str = "gate"           # the router module's name (gpt-oss, Llama 4: "router")
    router_bias: bool = False           # the router's logits have a bias (gpt-oss)
    weight_input: bool = False          # the weights scale the experts' input (Llama 4)
    layout: str = "rows"                # how Hugging Face stores the experts (LAYOUTS)
    expert_bias: bool = False           # gate_up_proj_bias [E, 2F], down_proj_bias [E, h]
    swiglu_limit: float = 7.0           # "swiglu_clamped": gate <= limit, |up| <= limit
    swiglu_alpha: float = 1.702         # ... gate * sigmoid(alpha * gate) * (up + 1)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.tsp_size

    def options(self) -> dict:
        """The keyword arguments of :class:`TSPMoE` beyond the shapes: how it routes, how its
        experts compute and are stored, and what runs beside them (``parallelize`` builds the
        layers with them)."""
        shapes = ("hidden_size", "intermediate_size", "num_experts", "top_k", "tsp_size")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in shapes}


# "softmax": softmax of every logit, top-k (Mixtral, Qwen3-MoE); "sigmoid": GLM-4.5's;
# "topk_softmax": top-k logits, softmax over them (gpt-oss); "topk_sigmoid": top-k logits,
# sigmoid of each (Llama 4)
ROUTERS = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid")
# the experts' tensors as Hugging Face stores them: "rows" gate_up_proj [E, 2F, h] (gate rows,
# then up) and down_proj [E, h, F] (Mixtral, Qwen3-MoE, GLM-4.5); "columns" [E, h, 2F] (gate
# columns, then up) and [E, F, h] (Llama 4); "interleaved" [E, h, 2F] with gate and up in
# alternate columns (gpt-oss)
LAYOUTS = ("rows", "columns", "interleaved")
EXPERT_ACTIVATIONS = (*ACTIVATIONS, "swiglu_clamped")


def check_router(spec: MoESpec) -> None:
    """Raise, naming the numbers, when the router's options cannot route (before any
    collective): an unknown kind, groups that do not divide the experts, too few experts in the
    chosen groups for the top-k; an unknown layout or activation."""
    E, k, g, tg = spec.num_experts, spec.top_k, spec.n_group, spec.topk_group
    if spec.router not in ROUTERS:
        raise ValueError(f"router {spec.router!r} is not one of {ROUTERS}")
    if spec.layout not in LAYOUTS:
        raise ValueError(f"experts layout {spec.layout!r} is not one of {LAYOUTS}")
    if spec.activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"activation {spec.activation!r} is not one of {EXPERT_ACTIVATIONS}")
    if spec.weight_input and spec.expert_bias:
        raise ValueError("weight_input (the weights scale the experts' input) with expert biases "
                         "is not implemented: no family has both")
    if spec.router != "sigmoid" and (g != 1 or tg != 1 or spec.correction_bias):
        raise ValueError(f"n_group ({g}), topk_group ({tg}) and the correction bias "
                         f"({spec.correction_bias}) belong to the \"sigmoid\" router; the "
                         f"{spec.router!r} router takes n_group=1, topk_group=1, "
                         f"correction_bias=False")
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


def router_logits(x: torch.Tensor, weight: torch.Tensor, spec: MoESpec,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Router logits [N, E] of tokens x [N, h] (plus ``bias``, gpt-oss): in the input's dtype,
    except for the sigmoid router, float32 at least (GLM-4.5 casts the input and the weight to
    float32; a float64 model stays float64)."""
    if spec.router == "sigmoid":
        wide = torch.promote_types(x.dtype, torch.float32)
        return F.linear(x.to(wide), weight.to(wide))
    return F.linear(x, weight, bias)


def route(logits: torch.Tensor, spec: MoESpec, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, expert indices) [N, k] of router logits [N, E], Hugging Face's numerics.
    "softmax" (Mixtral, Qwen3-MoE): softmax in float32, top-k, renormalised, and cast back for
    Qwen3-MoE. "sigmoid" (GLM-4.5): scores sigmoid(logits); the choice ranks scores + ``bias``
    (the correction bias: it moves which experts are chosen, never their weights), first the
    ``topk_group`` groups whose best two sum highest, then the top-k inside them; the weights
    are the chosen experts' scores, renormalised (``norm_topk``). "topk_softmax" (gpt-oss): the
    top-k logits, softmax over them in the logits' dtype. "topk_sigmoid" (Llama 4): the top-k
    logits, the sigmoid of each in float32 at least, cast back. All: times ``routed_scaling``."""
    if spec.router == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif spec.router == "sigmoid":
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
    else:
        top, experts = torch.topk(logits, spec.top_k, dim=-1)
        if spec.router == "topk_softmax":
            weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        else:
            weights = top.to(torch.promote_types(top.dtype, torch.float32)).sigmoid().to(top.dtype)
    if spec.routed_scaling != 1.0:
        weights = weights * spec.routed_scaling
    if spec.weights_in_logits_dtype:
        weights = weights.to(logits.dtype)
    return weights, experts


def dense_weights(weights: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The top-k ``weights`` [N, k] scattered into [N, E] (zero where not chosen): the experts'
    down-projection biases of every token are then one product with [E, h] (gpt-oss's
    ``down_proj_bias``, each chosen expert's bias times its weight)."""
    return weights.new_zeros(weights.shape[0], num_experts).scatter(1, experts, weights)


def glu(g: torch.Tensor, u: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """An expert's intermediate from its gate and up projections: ``act(g) * u``, or gpt-oss's
    clamped SwiGLU ``(clamp(u, -l, l) + 1) * gc * sigmoid(alpha * gc)``, gc = min(g, l)."""
    if spec.activation != "swiglu_clamped":
        return _act(g, spec.activation) * u
    gc = g.clamp(max=spec.swiglu_limit)
    return (u.clamp(-spec.swiglu_limit, spec.swiglu_limit) + 1) * (gc * torch.sigmoid(
        gc * spec.swiglu_alpha))


def glu_backward(g: torch.Tensor, u: torch.Tensor, dm: torch.Tensor, spec: MoESpec
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) of :func:`glu` given its output gradient ``dm`` (consumed: reused in place).
    A clamp passes the gradient where its input is inside the bounds, limits included, as
    torch.clamp's backward does."""
    if spec.activation != "swiglu_clamped":
        a = _act(g, spec.activation)
        du = dm * a
        del a
        return dm.mul_(u).mul_(_act_grad(g, spec.activation)), du
    lim, alpha = spec.swiglu_limit, spec.swiglu_alpha
    gc = g.clamp(max=lim)
    s = torch.sigmoid(gc * alpha)
    du = (gc * s).mul_(dm).mul_((u >= -lim) & (u <= lim))
    ds = (1 - s).mul_(gc).mul_(alpha).add_(1).mul_(s)       # d(gc sigmoid(alpha gc)) / d gc
    del s, gc
    dg = dm.mul_(u.clamp(-lim, lim).add_(1)).mul_(ds).mul_(g <= lim)
    return dg, du


def expert_views(spec: MoESpec, tensors: Sequence[torch.Tensor], e: int, split: bool = False
                 ) -> tuple[torch.Tensor, ...]:
    """(gate [F', h], up [F', h], down [h, F'], gate bias, up bias) of local expert ``e`` as
    views of the experts' ``tensors`` in Hugging Face's layout (``spec.layout``): ``gate_up,
    down[, gate_up_bias]``, or with ``split`` (the ring schedule's "rows" and "columns") ``gate,
    up, down``. The same views of gradient accumulators of the same shapes take the gradients in
    place. The biases are None without ``expert_bias``."""
    if split:
        g, u, d = (t[e] for t in tensors[:3])
        if spec.layout == "columns":
            g, u, d = g.t(), u.t(), d.t()
        return g, u, d, None, None
    gu, d = tensors[0][e], tensors[1][e]
    if spec.layout != "rows":
        gu, d = gu.t(), d.t()
    b = tensors[2][e] if len(tensors) > 2 else None
    if spec.layout == "interleaved":
        return gu[0::2], gu[1::2], d, *((None, None) if b is None else (b[0::2], b[1::2]))
    f = gu.shape[0] // 2
    return gu[:f], gu[f:], d, *((None, None) if b is None else (b[:f], b[f:]))


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
    that expert, ``tile`` of them at a time, and adds the weighted partial outputs (with
    ``weight_input``, Llama 4, the partial outputs of the weighted input). The backward
    circulates the slices again, recomputing the activations a tile at a time, with each slice's
    gradient accumulator following it (:func:`comm.ring_over_shards_with_grads`). Kept for
    backward: the input, the routing and this rank's own slices; the working set is a few
    [tile, F/D] tensors (:mod:`.tiles`) and the tile's rows, whatever the number of tokens.
    ``own``: this rank's slices, ``gate, up, down`` ("rows", "columns") or ``gate_up, down[,
    gate_up_bias]`` ("interleaved": a slice of channels is one run of columns)."""

    @staticmethod
    def forward(ctx, x, weights, experts, spec: MoESpec, group, tile, *own):
        pack = FlatPack([t.shape for t in own])
        split = spec.layout != "interleaved"
        routed = _by_expert(experts, spec.num_experts)
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
        ctx.spec, ctx.group, ctx.pack, ctx.routed, ctx.tile = spec, group, pack, routed, tile
        ctx.save_for_backward(x, weights, *own)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        spec, pack, routed, tile = ctx.spec, ctx.pack, ctx.routed, ctx.tile
        split = spec.layout != "interleaved"
        x, weights, *own = ctx.saved_tensors
        dy = dy.contiguous()
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

        grad = comm.ring_over_shards_with_grads(pack.pack(own), ctx.group, contribute)
        return (dx, dw.to(weights.dtype), None, None, None, None, *pack.unpack(grad))


class TSPMoE(TokenTiled, ShardedModule):
    """A sparse mixture-of-experts block with Hugging Face's names and shapes: the router
    ``<router_name>.weight`` [E, h] (and ``.bias`` [E], gpt-oss; replicated), the experts as the
    family stores them (``layout``, :data:`LAYOUTS`: ``experts.gate_up_proj`` [E, 2F, h] and
    ``experts.down_proj`` [E, h, F] for "rows"; [E, h, 2F] and [E, F, h] otherwise; with
    ``expert_bias`` ``experts.gate_up_proj_bias`` [E, 2F] and ``experts.down_proj_bias`` [E, h],
    the latter replicated: it is added per token after the experts, each chosen expert's bias
    times its weight, one [N, E] x [E, h] product). ``schedule`` "expert": split by whole experts
    over the TSP group; "ring": every expert split by intermediate channels (for "rows" and
    "columns" kept as ``experts.gate_proj`` and ``experts.up_proj``, named and loaded as the
    fused ``gate_up_proj`` in every full state dict and checkpoint; an "interleaved" slice of
    channels is one run of columns of ``gate_up_proj``). ``options``: the other
    :class:`MoESpec` fields. ``forward(x)`` takes this rank's tokens [B, S/D, h] (``returns_pair``:
    see :meth:`forward`)."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, intermediate_size: int, num_experts: int,
                 top_k: int, *, schedule: str = "expert", dtype: torch.dtype | None = None,
                 router_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_seed: int | None = 0,
                 tile_tokens: int | None = None, returns_pair: bool = False,
                 **options) -> None:
        super().__init__()
        self.tile_tokens, self.returns_pair = tile_tokens, returns_pair
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
        check_moe_shape(mesh.size, num_experts, top_k, schedule)
        if schedule == "ring" and intermediate_size % mesh.size:
            hint = valid_sizes_hint(valid_tsp_sizes(None, None, intermediate_size),
                                    f"the experts' intermediate size {intermediate_size}")
            raise ValueError(f"tsp_size ({mesh.size}) must divide the experts' intermediate size "
                             f"({intermediate_size}) under the ring schedule; {hint}")
        self.spec = s = MoESpec(hidden_size, intermediate_size, num_experts, top_k, mesh.size,
                                **options)
        check_router(s)
        fs = s.shared_intermediate_size
        if fs % mesh.size:
            hint = valid_sizes_hint(valid_tsp_sizes(None, None, fs),
                                    f"the shared experts' intermediate size {fs}")
            raise ValueError(f"tsp_size ({mesh.size}) must divide the shared experts' "
                             f"intermediate size ({fs}): they run as the dense TSP MLP; {hint}")
        if s.expert_bias and s.layout != "interleaved":
            raise ValueError(f"expert biases are implemented for the \"interleaved\" layout "
                             f"(gpt-oss), not {s.layout!r}")
        self.mesh, self.schedule = mesh, schedule
        h, f, e = hidden_size, intermediate_size, num_experts
        r = s.router_name
        self.router_names = (f"{r}.weight", *((f"{r}.bias",) if s.router_bias else ()))
        shapes = {f"{r}.weight": (e, h), f"{r}.bias": (e,)}
        rows = s.layout == "rows"
        gate_up, down = ((e, 2 * f, h), (e, h, f)) if rows else ((e, h, 2 * f), (e, f, h))
        if schedule == "expert" or s.layout == "interleaved":
            self.expert_names = ("experts.gate_up_proj", "experts.down_proj",
                                 *(("experts.gate_up_proj_bias",) if s.expert_bias else ()))
            shapes.update({"experts.gate_up_proj": gate_up, "experts.down_proj": down,
                           "experts.gate_up_proj_bias": (e, 2 * f)})
        else:  # the ring's gate and up slices, fused by name below
            self.expert_names = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
            part = (e, f, h) if rows else (e, h, f)
            shapes.update({"experts.gate_proj": part, "experts.up_proj": part,
                           "experts.down_proj": down})
        self.down_bias = ("experts.down_proj_bias",) if s.expert_bias else ()
        shapes["experts.down_proj_bias"] = (e, h)
        # the shared experts: TSPGatedMLP's parameters and schedule, on this rank's own tokens
        self.shared = tuple(f"{s.shared_name}.{p}_proj.weight" for p in ("gate", "up", "down"))
        shapes.update({self.shared[0]: (fs, h), self.shared[1]: (fs, h), self.shared[2]: (h, fs)})
        self.names = (*self.router_names, *self.expert_names, *self.down_bias,
                      *(self.shared if fs else ()))
        self.full_shapes = {n: shapes[n] for n in self.names}
        self.router_logits: torch.Tensor | None = None
        full = init_full(self.full_shapes, init_seed, dtype, device)
        if router_dtype is not None:  # GLM-4.5's router weight stays float32 in a bf16 model
            full[f"{r}.weight"] = full[f"{r}.weight"].to(router_dtype)
        self._create(full)
        if schedule == "ring" and s.layout != "interleaved":
            self.fuse_tensors("experts.gate_up_proj", ("experts.gate_proj", "experts.up_proj"),
                              1 if rows else 2)
        if s.correction_bias:  # a buffer (not trained), float32 at least, as Hugging Face keeps it
            wide = torch.promote_types(dtype or torch.get_default_dtype(), torch.float32)
            self.router_module.register_buffer("e_score_correction_bias",
                                        torch.zeros(e, dtype=wide, device=device))

    @property
    def router_module(self) -> torch.nn.Module:
        """The router's module (Hugging Face's ``gate`` or ``router``)."""
        return getattr(self, self.spec.router_name)

    def load_full(self, full) -> None:
        """The parameters' slices, and the correction bias whole where ``full`` has it (a
        checkpoint may leave a buffer out: it keeps its value)."""
        super().load_full(full)
        name = f"{self.spec.router_name}.e_score_correction_bias"
        if self.spec.correction_bias:
            source = TensorSource(full) if isinstance(full, Mapping) else full
            if source.shape(name) is not None:
                with torch.no_grad():
                    self.router_module.e_score_correction_bias.copy_(source.read(name, None, 0, 0))

    def _route(self, x2: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None
               ) -> tuple[torch.Tensor, ...]:
        """(logits, top-k weights, experts) of tokens x2 [N, h] with router weight ``router``
        (and logits bias ``bias``)."""
        logits = router_logits(x2, router, self.spec, bias)
        choice = self.router_module.e_score_correction_bias if self.spec.correction_bias else None
        return (logits, *route(logits, self.spec, choice))

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden_size={s.hidden_size}, intermediate_size={s.intermediate_size}, "
                f"experts={s.num_experts}, top_k={s.top_k}, tsp_size={s.tsp_size}, "
                f"schedule={self.schedule}, router={s.router}, layout={s.layout}"
                + (f", shared={s.shared_intermediate_size}" if s.shared_intermediate_size else ""))

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        s = self.spec
        if name in self.router_names or name in self.down_bias:
            return REPLICATED
        if name in self.shared:  # the dense TSP MLP's slices of intermediate channels
            return even_spec(s.shared_intermediate_size, rank, s.tsp_size,
                             1 if name == self.shared[2] else 0)
        if self.schedule == "expert":
            return even_spec(s.num_experts, rank, s.tsp_size, 0)
        # the ring: the intermediate channels' dim ([E, F or 2F, ...] or [E, ..., F or 2F])
        down = name == "experts.down_proj"
        dim = (2 if down else 1) if s.layout == "rows" else (1 if down or "bias" in name else 2)
        return even_spec(self.full_shapes[name][dim], rank, s.tsp_size, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens' output; with ``returns_pair`` (gpt-oss's and Llama 4's blocks
        return a pair their layer unpacks) (output, router logits)."""
        if self.tsp_decode is not None:  # generation: x identical on every rank
            y = self.tsp_decode.mlp(self, x)
            return (y, None) if self.returns_pair else y
        y, logits = self._forward(x)
        return (y, logits) if self.returns_pair else y

    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        check_local_input(x, s.hidden_size)
        x, weights, context = schedule_inputs(self, list(self.names[len(self.router_names):]), x)
        experts_weights = weights[:len(self.expert_names)]
        down_bias = weights[len(self.expert_names):][:len(self.down_bias)]
        shared = weights[len(self.expert_names) + len(self.down_bias):]
        router = [local(self.get_parameter(n)) for n in self.router_names]
        if s.router != "sigmoid":  # the input's dtype (autocast's, as the other weights)
            router = [w.to(x.dtype) for w in router]  # the sigmoid router widens it itself
        with context:
            x2 = x.reshape(-1, s.hidden_size)
            router = [comm.sum_grad(w, self.mesh.group) for w in router]
            logits, weights, experts = self._route(x2, *router, *(None,) * (2 - len(router)))
            if not recomputing():  # the load-balancing loss reads the forward's, not a recompute's
                self.router_logits = logits
            if self.schedule == "expert":
                # a tile's gate and up are two [tile, F] products: count 2F channels
                tile = self.tile_tokens or mlp_tile_tokens(2 * s.intermediate_size, x.dtype)
                y = dispatch_combine(x2, weights, experts, experts_weights, s, self.mesh.group,
                                     tile)
            else:
                tile = self.tile_tokens or mlp_tile_tokens(s.intermediate_size // s.tsp_size,
                                                           x.dtype)
                y = _RingExpertsFn.apply(x2, weights, experts, s, self.mesh.group, tile,
                                         *experts_weights)
            if down_bias:  # each chosen expert's bias, times its weight
                bias = comm.sum_grad(down_bias[0], self.mesh.group)
                y = y + (dense_weights(weights, experts, s.num_experts).to(bias.dtype) @ bias
                         ).to(y.dtype)
            y = y.view(x.shape)
            if shared:  # Hugging Face adds them after the routed experts' sum
                spec = MLPSpec(s.hidden_size, s.shared_intermediate_size, s.tsp_size,
                               s.activation)
                tile = self.tile_tokens or mlp_tile_tokens(
                    s.shared_intermediate_size // s.tsp_size, x.dtype)
                y = y + _TSPGatedMLPFn.apply(x, spec, self.mesh.group, tile, *shared)
        return y, logits

    def decode_step(self, x: torch.Tensor) -> torch.Tensor:
        """Generation: ``x`` [..., h] identical on every rank; each rank adds what it holds (its
        own experts, or its channels of every expert) for each token's experts, weighted; an
        all-reduce sums them. No token or weight moves. Replicated tensors (the down-projection
        biases) are added after the sum, once."""
        s = self.spec
        x2 = x.reshape(-1, s.hidden_size)
        router = [local(self.get_parameter(n)) for n in self.router_names]
        _, weights, experts = self._route(x2, *router, *(None,) * (2 - len(router)))
        tensors = [local(self.get_parameter(n)) for n in self.expert_names]
        expert = self.schedule == "expert"
        first, owned = ((self.mesh.rank * s.local_experts, range(s.local_experts)) if expert
                        else (0, range(s.num_experts)))
        split = not expert and s.layout != "interleaved"
        y = torch.zeros_like(x2)
        for e in owned:
            token, slot = torch.where(experts == first + e)
            if token.numel():
                wg, wu, wd, bg, bu = expert_views(s, tensors, e, split)
                w = weights[token, slot, None]
                xe = x2[token] * w.to(x2.dtype) if s.weight_input else x2[token]
                out = F.linear(glu(F.linear(xe, wg, bg), F.linear(xe, wu, bu), s), wd)
                y.index_add_(0, token, (out if s.weight_input else out * w).to(y.dtype))
        if s.shared_intermediate_size:  # this rank's channels of the shared experts: summed
            wg, wu, wd = (local(self.get_parameter(n)) for n in self.shared)  # apart, added
            shared = (_act(F.linear(x2, wg), s.activation) * F.linear(x2, wu)) @ wd.t()  # after
            both = torch.stack([y, shared])
            comm.all_reduce(both, self.mesh.group)  # one all-reduce for both
            y = both[0] + both[1]
        else:
            comm.all_reduce(y, self.mesh.group)
        if self.down_bias:
            bias = local(self.get_parameter(self.down_bias[0]))
            y = y + (dense_weights(weights, experts, s.num_experts).to(bias.dtype) @ bias
                     ).to(y.dtype)
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

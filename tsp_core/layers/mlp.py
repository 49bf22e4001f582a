"""TSP gated MLP (docs/design.md "Gated MLP"): the MLP is a sum over intermediate-channel slices and
acts token by token, so the weight slices travel around the ring while every rank's tokens stay put.

Forward: rank p starts with its own slice; at each of the D steps it computes with the slice it
holds while that slice moves on to p+1 and the next arrives from p-1 (double-buffered async P2P).
Backward: the slices circulate again; each slice is followed by its gradient accumulator, to which
every rank adds its tokens' contribution; one last hop brings the summed gradient to its owner.
Only this rank's own slice and its input are kept for backward (docs/design.md "Memory rules").
The ungated MLP ``down(act(up(x)))`` (:class:`TSPPlainMLP`, Apertus's xIELU) runs the same ring:
one tile loop (:func:`_ring_forward`, :func:`_ring_backward`) with each MLP's tile math.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..distributed import comm
from ..distributed.flat_pack import FlatPack
from ..distributed.mesh import TSPMesh
from ..distributed.params import (
    REPLICATED,
    FullSource,
    ShardedModule,
    ShardSpec,
    TensorSource,
    even_spec,
    init_full,
    local,
    local_replicated,
    schedule_inputs,
)
from .inputs import check_local_input
from .lora import (
    LowRank,
    add_input,
    input_backward,
    output_backward,
    output_part,
    schedule_adapters,
)
from .nf4 import pack_of, restored, tensors_only
from .sizes import valid_sizes_hint, valid_tsp_sizes
from .tiles import (
    MLP_TILE_TENSORS,
    TokenTiled,
    grad_accumulator,
    mlp_tile_tokens,
    token_tiles,
)

ACTIVATIONS = ("silu", "gelu_tanh")
# the per-tile hooks of the shared ring loop (_ring_forward, _ring_backward): a tile's
# intermediate from (xt, input projections, their biases, the shard's owner, the tile's slice of
# the local tokens), and its backward from (xt, dyt, input projections, down, biases, down's
# gradient accumulator or None when frozen, owner, slice) -> the pre-activation gradients
Views = Sequence[torch.Tensor | None]
TileForward = Callable[[torch.Tensor, Views, Views, int, slice], torch.Tensor]
TileBackward = Callable[[torch.Tensor, torch.Tensor, Views, torch.Tensor, Views,
                         torch.Tensor | None, int, slice], list[torch.Tensor]]


def activate(g: torch.Tensor, kind: str) -> torch.Tensor:
    return F.silu(g) if kind == "silu" else F.gelu(g, approximate="tanh")


def activation_grad(g: torch.Tensor, kind: str) -> torch.Tensor:
    """d act(g) / d g, elementwise, the same operations in the same order as the formulas
    ``s (1 + g (1 - s))`` (SiLU, s = sigmoid(g)) and ``0.5 (1 + t) + 0.5 g (1 - t^2) c (1 + 3 k
    g^2)`` (tanh-GELU, t = tanh(c (g + k g^3))), but in place: at most three tensors the size
    of ``g`` exist at once, result included (:data:`tiles.MLP_TILE_TENSORS` counts them)."""
    if kind == "silu":
        s = torch.sigmoid(g)
        return (1 - s).mul_(g).add_(1).mul_(s)
    c, k = 0.7978845608028654, 0.044715  # sqrt(2 / pi), tanh-GELU's cubic coefficient
    t = (g ** 3).mul_(k).add_(g).mul_(c).tanh_()
    q = (t * t).neg_().add_(1)              # 1 - t^2
    q = (g * 0.5).mul_(q).mul_(c)           # 0.5 g (1 - t^2) c
    q.mul_((g * (3 * k)).mul_(g).add_(1))   # ... (1 + 3 k g^2)
    return t.add_(1).mul_(0.5).add_(q)      # 0.5 (1 + t) + ...


@dataclass(frozen=True)
class MLPSpec:
    hidden_size: int
    intermediate_size: int
    tsp_size: int
    activation: str = "silu"
    lora: LowRank = field(default_factory=LowRank)  # this call's adapters (.lora)

    def channels(self, owner: int) -> slice:
        """The intermediate channels of ``owner``'s shard."""
        per = self.intermediate_size // self.tsp_size
        return slice(owner * per, (owner + 1) * per)


def _split(views: list[torch.Tensor], n_in: int):
    """A shard's views in :class:`FlatPack` order -> (input projections, down, their biases):
    ``n_in`` input projections (gate and up, or up alone), down, then one bias per input
    projection when the MLP has biases (down's is replicated, outside the ring)."""
    ins, wd, biases = views[:n_in], views[n_in], views[n_in + 1:]
    return ins, wd, biases or [None] * n_in


def _ring_forward(x: torch.Tensor, group, pack: FlatPack, weights, tile: int, n_in: int,
                  intermediate: TileForward) -> torch.Tensor:
    """The ring schedule's forward, shared by the gated and the plain MLP: for each weight shard
    (:func:`comm.ring_over_shards`) and each tile of this rank's tokens, ``intermediate(xt,
    ins, biases)`` (the tile's [tile, F/D] product of the input projections and the activation)
    times the shard's down columns, added into the output."""
    B, L, h = x.shape
    x2 = x.reshape(B * L, h)
    out = x.new_zeros(B, L, h)  # not a view: a LoRA adapter adds into it in place (.lora)
    y = out.view(B * L, h)
    tiles = token_tiles(B * L, tile)

    def compute(owner: int, shard: torch.Tensor) -> None:
        ins, wd, biases = _split(pack.unpack(shard), n_in)
        for sl in tiles:
            m = intermediate(x2[sl], ins, biases, owner, sl)
            y[sl].addmm_(m, wd.t())
            del m  # before the next tile's

    comm.ring_over_shards(pack.pack(weights), group, compute)
    return out


def _ring_backward(x: torch.Tensor, dy: torch.Tensor, group, pack: FlatPack, weights,
                   tile: int, n_in: int, tile_backward: TileBackward,
                   weight_grads: bool = True):
    """The ring schedule's backward, shared by the gated and the plain MLP: the shards circulate
    again (:func:`comm.ring_over_shards_with_grads`); for each tile, ``tile_backward(xt, dyt,
    ins, wd, biases, d_wd)`` recomputes the tile's intermediate (only the input is kept for
    backward), adds its down gradient into ``d_wd`` and returns the input projections'
    pre-activation gradients; from those the tile's input gradient and the projections' weight
    (and bias) gradients, summed over the tiles (:func:`tiles.grad_accumulator`). Returns
    (dx [B, L, h], the gradient of this rank's own shard, packed). Without ``weight_grads``
    (frozen weights) the shards circulate for dx alone: no gradient hop, None for the shard."""
    B, L, h = x.shape
    x2, dy2 = x.reshape(B * L, h), dy.reshape(B * L, h)
    dx = torch.zeros_like(x2)
    tiles = token_tiles(B * L, tile)

    def contribute(owner: int, shard: torch.Tensor) -> torch.Tensor | None:
        ins, wd, biases = _split(pack.unpack(shard), n_in)
        if not weight_grads:
            for sl in tiles:
                d_pre = tile_backward(x2[sl], dy2[sl], ins, wd, biases, None, owner, sl)
                for i, w in enumerate(ins):
                    dx[sl].addmm_(d_pre[i], w)
            return None
        grads = grad_accumulator(pack.numel, shard.dtype, shard.device, len(tiles))
        d_ins, d_wd, d_biases = _split(pack.unpack(grads), n_in)
        for sl in tiles:
            xt = x2[sl]
            d_pre = tile_backward(xt, dy2[sl], ins, wd, biases, d_wd, owner, sl)
            for i, w in enumerate(ins):
                dx[sl].addmm_(d_pre[i], w)
            for i, g in enumerate(d_ins):
                g.add_(d_pre[i].t() @ xt)
            if biases[0] is not None:
                for i, g in enumerate(d_biases):
                    g.add_(d_pre[i].sum(0))
            del d_pre  # before the next tile's
        return grads.to(shard.dtype)

    if not weight_grads:
        comm.ring_over_shards(pack.pack(weights), group, contribute)
        return dx.view(B, L, h), None
    grad = comm.ring_over_shards_with_grads(pack.pack(weights), group, contribute)
    return dx.view(B, L, h), grad


class TSPGatedMLPFn(torch.autograd.Function):
    """The ring schedule over this rank's tokens in tiles of ``tile`` (docs/design.md "Long
    context"): for each weight shard, one tile's gate, up and activation at a time in the
    forward; the backward recomputes them a tile at a time and sums the shard's weight gradient
    over the tiles, so the working set is a few [tile, F/D] tensors (:mod:`.tiles`), whatever
    the number of local tokens.

    LoRA (``spec.lora``, :mod:`tsp_core.layers.lora`): a tile's gate and up get ``u @ B[ch]^T``
    for the shard's channels ``ch``, and the down adapter's ``z`` [B, L, r] (one more output)
    sums ``m @ A[:, ch]^T``. Frozen weights (none requires grad): no gradient hop."""

    @staticmethod
    def forward(ctx, x, spec: MLPSpec, group, tile: int, *weights):
        weights, low = spec.lora.split(weights)
        ctx.wgrad = any(ctx.needs_input_grad[4:4 + len(weights)])
        pack = pack_of(weights)  # NF4 shards travel packed (.nf4)
        x2 = x.reshape(-1, x.shape[-1])
        z = x.new_zeros(x2.shape[0], low["down_proj"][0].shape[0]) if "down_proj" in low else None

        def intermediate(xt, ins, biases, owner, sl):
            ch = spec.channels(owner)
            u_g, u_u = (_tokens(low.get(n), sl) for n in ("gate_proj", "up_proj"))
            m = (activate(add_input(F.linear(xt, ins[0], biases[0]), u_g, ch), spec.activation)
                 * add_input(F.linear(xt, ins[1], biases[1]), u_u, ch))
            if z is not None:
                output_part(z[sl], m, low["down_proj"], ch, sl)
            return m

        y = _ring_forward(x, group, pack, weights, tile, 2, intermediate)
        ctx.spec, ctx.group, ctx.pack, ctx.tile = spec, group, pack, tile
        saved, ctx.kept = tensors_only(weights)
        ctx.save_for_backward(x, *saved, *[t for ts in low.values() for t in ts])
        return y if z is None else (y, z.view(*x.shape[:-1], -1))

    @staticmethod
    def backward(ctx, dy, dz=None):
        spec = ctx.spec
        x, *saved = ctx.saved_tensors
        weights, low = spec.lora.split(saved)
        weights = restored(weights, ctx.kept)
        lgrads = spec.lora.zero_grads(low)
        dz2 = None if dz is None else dz.reshape(-1, dz.shape[-1])

        def tile_backward(xt, dyt, ins, wd, biases, d_wd, owner, sl):
            ch = spec.channels(owner)
            u_g, u_u = (_tokens(low.get(n), sl) for n in ("gate_proj", "up_proj"))
            g = add_input(F.linear(xt, ins[0], biases[0]), u_g, ch)  # recomputed: only the
            u = add_input(F.linear(xt, ins[1], biases[1]), u_u, ch)  # input is kept
            a = activate(g, spec.activation)
            if d_wd is not None:
                d_wd.add_(dyt.t() @ (a * u))
            dm = dyt @ wd
            if dz2 is not None:  # the down adapter's share of the gradient
                dm = output_backward(dm, dz2[sl], a * u, low["down_proj"],
                                     lgrads["down_proj"], ch, sl)
            du = dm * a
            del a
            dg = dm.mul_(u)
            del u
            dg.mul_(activation_grad(g, spec.activation))
            input_backward(dg, low.get("gate_proj"), lgrads.get("gate_proj"), ch, sl)
            input_backward(du, low.get("up_proj"), lgrads.get("up_proj"), ch, sl)
            return [dg, du]

        dx, grad = _ring_backward(x, dy, ctx.group, ctx.pack, weights, ctx.tile, 2,
                                  tile_backward, weight_grads=ctx.wgrad)
        own = ctx.pack.unpack(grad) if grad is not None else [None] * len(weights)
        return (dx, None, None, None, *own, *spec.lora.grads(lgrads))


def _tokens(low: tuple[torch.Tensor, ...] | None, sl: slice
            ) -> tuple[torch.Tensor, ...] | None:
    """An input-side adapter's (u, B) with u cut to the tile ``sl`` of the flat local tokens."""
    if low is None:
        return None
    u, b = low
    return u.reshape(-1, u.shape[-1])[sl], b


class TSPGatedMLP(TokenTiled, ShardedModule):
    """Gated MLP ``down(act(gate(x)) * up(x))`` with TSP: rank p owns intermediate channels
    [p*F/D, (p+1)*F/D) of ``gate_proj`` and ``up_proj`` and the same columns of ``down_proj``
    (Hugging Face names and shapes); down's bias is replicated. ``tile_tokens``: the local tokens
    are processed that many at a time (None: :func:`tiles.mlp_tile_tokens` of the sizes)."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, intermediate_size: int, *,
                 activation: str = "silu", bias: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_seed: int | None = 0,
                 tile_tokens: int | None = None) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
        self.tile_tokens = tile_tokens
        if intermediate_size % mesh.size:
            hint = valid_sizes_hint(valid_tsp_sizes(None, None, intermediate_size),
                                    f"intermediate_size {intermediate_size}")
            raise ValueError(f"tsp_size ({mesh.size}) must divide intermediate_size "
                             f"({intermediate_size}); {hint}")
        self.mesh = mesh
        self.spec = MLPSpec(hidden_size, intermediate_size, mesh.size, activation)
        f, h = intermediate_size, hidden_size
        self.full_shapes = {"gate_proj.weight": (f, h), "up_proj.weight": (f, h),
                            "down_proj.weight": (h, f)}
        if bias:
            self.full_shapes.update({"gate_proj.bias": (f,), "up_proj.bias": (f,),
                                     "down_proj.bias": (h,)})
        self._create(init_full(self.full_shapes, init_seed, dtype, device))

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden_size={s.hidden_size}, intermediate_size={s.intermediate_size}, "
                f"tsp_size={s.tsp_size}, activation={s.activation}")

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        if name == "down_proj.bias":
            return REPLICATED
        dim = 1 if name == "down_proj.weight" else 0
        return even_spec(self.spec.intermediate_size, rank, self.spec.tsp_size, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tsp_decode is not None:  # generation: x identical on every rank
            return self.tsp_decode.mlp(self, x)
        s = self.spec
        check_local_input(x, s.hidden_size)
        names = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
        if "gate_proj.bias" in self.full_shapes:
            names += ["gate_proj.bias", "up_proj.bias"]
        x, weights, context = schedule_inputs(self, names, x)
        tile = self.tile_tokens or mlp_tile_tokens(s.intermediate_size // s.tsp_size, x.dtype)
        x, low, tensors, adapters = schedule_adapters(self, ("gate_proj", "up_proj",
                                                             "down_proj"), x)
        if low is not None:  # LoRA (tsp_core.layers.lora): the call's adapters join the ring
            s = dataclasses.replace(s, lora=low)
        with context:
            y = TSPGatedMLPFn.apply(x, s, self.mesh.group, tile, *weights, *tensors)
        if "down_proj" in adapters:
            y, z = y
            y = adapters["down_proj"].add_output(y, z)
        if "down_proj.bias" in self.full_shapes:
            y = y + local_replicated(self.down_proj.bias, self.mesh)
        return y


# ------------------------------------------------------------------ the plain (ungated) MLP

PLAIN_ACTIVATIONS = ("silu", "gelu_tanh", "xielu")
# [tile, F/D] tensors one plain MLP tile holds at once, by activation (its backward's peak, measured
# by tests/layers/test_tiles.py): SiLU's and tanh-GELU's under tiles.MLP_TILE_TENSORS; xIELU's
# autograd keeps both branches' intermediates, so its tile is chosen as if for more channels
PLAIN_TILE_TENSORS = {"silu": 4, "gelu_tanh": 4, "xielu": 11}
# xIELU's constants and its learnable scalars' initial values (transformers' XIELUActivation)
XIELU_INIT = dict(alpha_p=0.8, alpha_n=0.8, beta=0.5, eps=-1e-6)


def _plain_act(u: torch.Tensor, kind: str, scalars: list[torch.Tensor],
               consts: list[torch.Tensor]) -> torch.Tensor:
    """The plain MLP's activation: SiLU, tanh-GELU, or xIELU (Apertus) with its learnable
    ``alpha_p``, ``alpha_n`` (``scalars``) and ``beta``, ``eps`` (``consts``), the operations
    of transformers' ``XIELUActivation._xielu_python`` in its order."""
    if kind != "xielu":
        return activate(u, kind)
    raw_p, raw_n = scalars
    beta, eps = consts
    alpha_p = F.softplus(raw_p)
    alpha_n = beta + F.softplus(raw_n)
    return torch.where(u > 0, alpha_p * u * u + beta * u,
                       (torch.expm1(torch.min(u, eps)) - u) * alpha_n + beta * u)


def plain_tile_tokens(local_channels: int, dtype: torch.dtype, activation: str) -> int:
    """The plain MLP's tile (``tile_tokens=None``): :func:`tiles.mlp_tile_tokens` of
    ``local_channels`` (F/D) times the multiple of :data:`tiles.MLP_TILE_TENSORS` its
    activation's :data:`PLAIN_TILE_TENSORS` needs (1 for SiLU and tanh-GELU, 2 for xIELU), so
    that its working set stays under :data:`tiles.TILE_BYTES` as the gated MLP's does."""
    widen = -(-PLAIN_TILE_TENSORS[activation] // MLP_TILE_TENSORS)
    return mlp_tile_tokens(local_channels * widen, dtype)


@dataclass(frozen=True)
class PlainMLPSpec:
    hidden_size: int
    intermediate_size: int
    tsp_size: int
    activation: str = "xielu"


class _TSPPlainMLPFn(torch.autograd.Function):
    """``down(act(up(x)))`` on the ring schedule of :class:`TSPGatedMLPFn` (the same tile loop,
    the same shard and gradient hops). The activation's learnable scalars are replicated: their
    gradient is this rank's sum over every shard and tile (the caller's ``sum_grad`` adds the
    other ranks'). The backward differentiates the activation with autograd, a tile at a time,
    on the recomputed ``up`` (the same operations as the forward, for any activation)."""

    @staticmethod
    def forward(ctx, x, spec: PlainMLPSpec, group, tile: int, consts: list, n_weights: int,
                *tensors):
        weights, scalars = tensors[:n_weights], list(tensors[n_weights:])
        pack = FlatPack([w.shape for w in weights])

        def intermediate(xt, ins, biases, _owner, _sl):
            return _plain_act(F.linear(xt, ins[0], biases[0]), spec.activation, scalars, consts)

        y = _ring_forward(x, group, pack, weights, tile, 1, intermediate)
        ctx.spec, ctx.group, ctx.pack, ctx.tile, ctx.consts = spec, group, pack, tile, consts
        ctx.save_for_backward(x, *weights, *scalars)
        ctx.n_weights = n_weights
        return y

    @staticmethod
    def backward(ctx, dy):
        spec, consts = ctx.spec, ctx.consts
        x, *rest = ctx.saved_tensors
        weights, scalars = rest[:ctx.n_weights], rest[ctx.n_weights:]
        wide = torch.promote_types(x.dtype, torch.float32)
        d_scalars = [torch.zeros(s.shape, dtype=wide, device=s.device) for s in scalars]
        leaves = [s.detach().requires_grad_() for s in scalars]

        def tile_backward(xt, dyt, ins, wd, biases, d_wd, _owner, _sl):
            with torch.enable_grad():  # up recomputed: only the input is kept for backward
                u = F.linear(xt, ins[0], biases[0]).requires_grad_()
                a = _plain_act(u, spec.activation, leaves, consts)
            d_wd.add_(dyt.t() @ a.detach())
            du, *ds = torch.autograd.grad(a, [u, *leaves], dyt @ wd)
            del a, u
            for acc, g in zip(d_scalars, ds):
                acc.add_(g)
            return [du]

        dx, grad = _ring_backward(x, dy, ctx.group, ctx.pack, weights, ctx.tile, 1,
                                  tile_backward)
        d_scalars = [g.to(s.dtype) for g, s in zip(d_scalars, scalars)]
        return (dx, None, None, None, None, None, *ctx.pack.unpack(grad), *d_scalars)


class TSPPlainMLP(TokenTiled, ShardedModule):
    """Ungated MLP ``down(act(up(x)))`` with TSP (Apertus): rank p owns intermediate channels
    [p*F/D, (p+1)*F/D) of ``up_proj`` (and its bias) and the same columns of ``down_proj``, as
    :class:`TSPGatedMLP` does without the gate; down's bias is replicated. xIELU's learnable
    scalars ``act_fn.alpha_p`` and ``act_fn.alpha_n`` are replicated parameters (their gradient
    summed over the group), its ``act_fn.beta`` and ``act_fn.eps`` buffers, all under Hugging
    Face's names. ``tile_tokens``: as :class:`TSPGatedMLP`'s (None: :func:`plain_tile_tokens`)."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, intermediate_size: int, *,
                 activation: str = "xielu", bias: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 init_seed: int | None = 0, tile_tokens: int | None = None) -> None:
        super().__init__()
        if activation not in PLAIN_ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {PLAIN_ACTIVATIONS}")
        self.tile_tokens = tile_tokens
        if intermediate_size % mesh.size:
            hint = valid_sizes_hint(valid_tsp_sizes(None, None, intermediate_size),
                                    f"intermediate_size {intermediate_size}")
            raise ValueError(f"tsp_size ({mesh.size}) must divide intermediate_size "
                             f"({intermediate_size}); {hint}")
        self.mesh = mesh
        self.spec = PlainMLPSpec(hidden_size, intermediate_size, mesh.size, activation)
        f, h = intermediate_size, hidden_size
        self.full_shapes = {"up_proj.weight": (f, h), "down_proj.weight": (h, f)}
        if bias:
            self.full_shapes.update({"up_proj.bias": (f,), "down_proj.bias": (h,)})
        self.scalar_names = ["act_fn.alpha_p", "act_fn.alpha_n"] if activation == "xielu" else []
        self.full_shapes.update({n: (1,) for n in self.scalar_names})
        full = init_full(self.full_shapes, init_seed, dtype, device)
        if activation == "xielu" and init_seed is not None:  # HF's: softplus^-1 of the alphas
            i = XIELU_INIT
            for name, value in (("alpha_p", i["alpha_p"]), ("alpha_n", i["alpha_n"] - i["beta"])):
                full[f"act_fn.{name}"] = torch.tensor([value]).expm1().log().to(
                    full[f"act_fn.{name}"])
        self._create(full)
        if activation == "xielu":
            for name in ("beta", "eps"):
                self.act_fn.register_buffer(name, torch.tensor(XIELU_INIT[name], dtype=dtype,
                                                               device=device))

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden_size={s.hidden_size}, intermediate_size={s.intermediate_size}, "
                f"tsp_size={s.tsp_size}, activation={s.activation}")

    def load_full(self, full: Mapping[str, torch.Tensor] | FullSource) -> None:
        """The parameters' slices, and the activation's buffers (xIELU's beta and eps) where
        ``full`` holds them (else they keep their values, as a module's buffers do)."""
        super().load_full(full)
        source = TensorSource(full) if isinstance(full, Mapping) else full
        with torch.no_grad():
            for name, b in self.named_buffers():
                if source.shape(name) is not None:
                    b.copy_(source.read(name, None, 0, 0))

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        if name == "down_proj.bias" or name in self.scalar_names:
            return REPLICATED
        dim = 1 if name == "down_proj.weight" else 0
        return even_spec(self.spec.intermediate_size, rank, self.spec.tsp_size, dim)

    def _consts(self) -> list[torch.Tensor]:
        return [self.act_fn.beta, self.act_fn.eps] if self.spec.activation == "xielu" else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tsp_decode is not None:  # generation: x identical on every rank
            return self.decode_step(x)
        s = self.spec
        check_local_input(x, s.hidden_size)
        names = ["up_proj.weight", "down_proj.weight"]
        if "up_proj.bias" in self.full_shapes:
            names.append("up_proj.bias")
        x, weights, context = schedule_inputs(self, names, x)
        scalars = [local_replicated(self.get_parameter(n), self.mesh).to(x.dtype)
                   for n in self.scalar_names]
        consts = [c.to(x.dtype) for c in self._consts()]
        tile = self.tile_tokens or plain_tile_tokens(s.intermediate_size // s.tsp_size, x.dtype,
                                                     s.activation)
        with context:
            y = _TSPPlainMLPFn.apply(x, s, self.mesh.group, tile, consts, len(weights),
                                     *weights, *scalars)
        if "down_proj.bias" in self.full_shapes:
            y = y + local_replicated(self.down_proj.bias, self.mesh)
        return y

    @torch.no_grad()
    def decode_step(self, x: torch.Tensor) -> torch.Tensor:
        """One generation step, x [B, 1, h] identical on every rank (docs/design.md "Decode"):
        this rank's channels, then one all-reduce; no weight moves."""
        w = {n: local(p) for n, p in self.named_parameters()}
        a = _plain_act(F.linear(x, w["up_proj.weight"], w.get("up_proj.bias")),
                       self.spec.activation, [w[n] for n in self.scalar_names], self._consts())
        y = a @ w["down_proj.weight"].t()
        comm.all_reduce(y, self.mesh.group)
        if "down_proj.bias" in w:
            y = y + w["down_proj.bias"]
        return y

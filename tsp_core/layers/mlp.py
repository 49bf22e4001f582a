"""TSP gated MLP (docs/design.md "Gated MLP"): the MLP is a sum over intermediate-channel slices and
acts token by token, so the weight slices travel around the ring while every rank's tokens stay put.

Forward: rank p starts with its own slice; at each of the D steps it computes with the slice it
holds while that slice moves on to p+1 and the next arrives from p-1 (double-buffered async P2P).
Backward: the slices circulate again; each slice is followed by its gradient accumulator, to which
every rank adds its tokens' contribution; one last hop brings the summed gradient to its owner.
Only this rank's own slice and its input are kept for backward (docs/design.md "Memory rules").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..distributed import comm
from ..distributed.flat_pack import FlatPack
from ..distributed.mesh import TSPMesh
from ..distributed.params import (
    REPLICATED,
    ShardedModule,
    ShardSpec,
    even_spec,
    init_full,
    local_replicated,
    schedule_inputs,
)
from .sizes import valid_sizes_hint, valid_tsp_sizes
from .tiles import TokenTiled, grad_accumulator, mlp_tile_tokens, token_tiles

ACTIVATIONS = ("silu", "gelu_tanh")


def _act(g: torch.Tensor, kind: str) -> torch.Tensor:
    return F.silu(g) if kind == "silu" else F.gelu(g, approximate="tanh")


def _act_grad(g: torch.Tensor, kind: str) -> torch.Tensor:
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


def check_local_input(x: torch.Tensor, hidden_size: int) -> None:
    """An MLP's input must be this rank's tokens [batch, local_seq, hidden_size]."""
    if x.dim() != 3 or x.shape[-1] != hidden_size:
        raise ValueError(f"input of shape {tuple(x.shape)} does not match the layer: expected "
                         f"[batch, local_seq, hidden_size={hidden_size}]")


@dataclass(frozen=True)
class MLPSpec:
    hidden_size: int
    intermediate_size: int
    tsp_size: int
    activation: str = "silu"


class _TSPGatedMLPFn(torch.autograd.Function):
    """The ring schedule over this rank's tokens in tiles of ``tile`` (docs/design.md "Long
    context"): for each weight shard, one tile's gate, up and activation at a time in the
    forward; the backward recomputes them a tile at a time and sums the shard's weight gradient
    over the tiles, so the working set is a few [tile, F/D] tensors (:mod:`.tiles`), whatever
    the number of local tokens."""

    @staticmethod
    def forward(ctx, x, spec: MLPSpec, group, tile: int, *weights):
        pack = FlatPack([w.shape for w in weights])
        B, L, h = x.shape
        x2 = x.reshape(B * L, h)
        y = torch.zeros_like(x2)
        tiles = token_tiles(B * L, tile)

        def compute(_owner: int, shard: torch.Tensor) -> None:
            wg, wu, wd, *b = pack.unpack(shard)
            bg, bu = b if b else (None, None)
            for sl in tiles:
                xt = x2[sl]
                m = _act(F.linear(xt, wg, bg), spec.activation) * F.linear(xt, wu, bu)
                y[sl].addmm_(m, wd.t())
                del m  # before the next tile's

        comm.ring_over_shards(pack.pack(weights), group, compute)
        ctx.spec, ctx.group, ctx.pack, ctx.tile = spec, group, pack, tile
        ctx.save_for_backward(x, *weights)
        return y.view(B, L, h)

    @staticmethod
    def backward(ctx, dy):
        spec, group, pack = ctx.spec, ctx.group, ctx.pack
        x, *weights = ctx.saved_tensors
        B, L, h = x.shape
        x2, dy2 = x.reshape(B * L, h), dy.reshape(B * L, h)
        dx = torch.zeros_like(x2)
        tiles = token_tiles(B * L, ctx.tile)

        def contribute(_owner: int, shard: torch.Tensor) -> torch.Tensor:
            wg, wu, wd, *b = pack.unpack(shard)
            bg, bu = b if b else (None, None)
            grads = grad_accumulator(pack.numel, shard.dtype, shard.device, len(tiles))
            d_wg, d_wu, d_wd, *d_b = pack.unpack(grads)
            for sl in tiles:
                xt, dyt = x2[sl], dy2[sl]
                g = F.linear(xt, wg, bg)  # recomputed: only the input is kept for backward
                u = F.linear(xt, wu, bu)
                a = _act(g, spec.activation)
                d_wd.add_(dyt.t() @ (a * u))
                dm = dyt @ wd
                du = dm * a
                del a
                dg = dm.mul_(u)
                del u
                dg.mul_(_act_grad(g, spec.activation))
                del g
                dx[sl].addmm_(dg, wg).addmm_(du, wu)
                d_wg.add_(dg.t() @ xt)
                d_wu.add_(du.t() @ xt)
                if d_b:
                    d_b[0].add_(dg.sum(0))
                    d_b[1].add_(du.sum(0))
                del dm, dg, du  # before the next tile's
            return grads.to(shard.dtype)

        grad = comm.ring_over_shards_with_grads(pack.pack(weights), group, contribute)
        return (dx.view(B, L, h), None, None, None, *pack.unpack(grad))


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
        with context:
            y = _TSPGatedMLPFn.apply(x, s, self.mesh.group, tile, *weights)
        if "down_proj.bias" in self.full_shapes:
            y = y + local_replicated(self.down_proj.bias, self.mesh)
        return y

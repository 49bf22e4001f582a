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

ACTIVATIONS = ("silu", "gelu_tanh")


def _act(g: torch.Tensor, kind: str) -> torch.Tensor:
    return F.silu(g) if kind == "silu" else F.gelu(g, approximate="tanh")


def _act_grad(g: torch.Tensor, kind: str) -> torch.Tensor:
    """d act(g) / d g, elementwise."""
    if kind == "silu":
        s = torch.sigmoid(g)
        return s * (1 + g * (1 - s))
    c = 0.7978845608028654  # sqrt(2 / pi)
    inner = c * (g + 0.044715 * g ** 3)
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * c * (1 + 3 * 0.044715 * g * g)


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
    @staticmethod
    def forward(ctx, x, spec: MLPSpec, group, *weights):
        pack = FlatPack([w.shape for w in weights])
        B, L, h = x.shape
        x2 = x.reshape(B * L, h)
        y = torch.zeros_like(x2)

        def compute(_owner: int, shard: torch.Tensor) -> None:
            wg, wu, wd, *b = pack.unpack(shard)
            bg, bu = b if b else (None, None)
            m = _act(F.linear(x2, wg, bg), spec.activation) * F.linear(x2, wu, bu)
            y.addmm_(m, wd.t())

        comm.ring_over_shards(pack.pack(weights), group, compute)
        ctx.spec, ctx.group, ctx.pack = spec, group, pack
        ctx.save_for_backward(x, *weights)
        return y.view(B, L, h)

    @staticmethod
    def backward(ctx, dy):
        spec, group, pack = ctx.spec, ctx.group, ctx.pack
        x, *weights = ctx.saved_tensors
        B, L, h = x.shape
        x2, dy2 = x.reshape(B * L, h), dy.reshape(B * L, h)
        dx = torch.zeros_like(x2)

        def contribute(_owner: int, shard: torch.Tensor) -> torch.Tensor:
            wg, wu, wd, *b = pack.unpack(shard)
            bg, bu = b if b else (None, None)
            g = F.linear(x2, wg, bg)  # recomputed: only the input is kept for backward
            u = F.linear(x2, wu, bu)
            a = _act(g, spec.activation)
            dm = dy2 @ wd
            d_wd = dy2.t() @ (a * u)
            du = dm * a
            dg = dm.mul_(u).mul_(_act_grad(g, spec.activation))
            del g, u, a
            dx.addmm_(dg, wg).addmm_(du, wu)
            grads = [dg.t() @ x2, du.t() @ x2, d_wd] + ([dg.sum(0), du.sum(0)] if b else [])
            return pack.pack(grads)

        grad = comm.ring_over_shards_with_grads(pack.pack(weights), group, contribute)
        return (dx.view(B, L, h), None, None, *pack.unpack(grad))


class TSPGatedMLP(ShardedModule):
    """Gated MLP ``down(act(gate(x)) * up(x))`` with TSP: rank p owns intermediate channels
    [p*F/D, (p+1)*F/D) of ``gate_proj`` and ``up_proj`` and the same columns of ``down_proj``
    (Hugging Face names and shapes); down's bias is replicated."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, intermediate_size: int, *,
                 activation: str = "silu", bias: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_seed: int | None = 0) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
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
        with context:
            y = _TSPGatedMLPFn.apply(x, s, self.mesh.group, *weights)
        if "down_proj.bias" in self.full_shapes:
            y = y + local_replicated(self.down_proj.bias, self.mesh)
        return y

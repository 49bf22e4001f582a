"""TSP gated MLP (DESIGN 3.2): the MLP is a sum over intermediate-channel slices and acts token by
token, so the weight slices travel around the ring while every rank's tokens stay put.

Forward: rank p starts with its own slice; at each of the D steps it computes with the slice it
holds while that slice moves on to p+1 and the next arrives from p-1 (double-buffered async P2P).
Backward: the slices circulate again; each slice is followed by its gradient accumulator, to which
every rank adds its tokens' contribution; one last hop brings the summed gradient to its owner.
Only this rank's own slice and its input are kept for backward (DESIGN 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import comm
from .mesh import TSPMesh
from .packing import FlatPack
from .params import (local, local_replicated, local_weights, replicated_parameter, shard_slice,
                     sharded_parameter)

ACTIVATIONS = ("silu", "gelu_tanh")
_WEIGHT_TAG, _GRAD_TAG = 1, 2


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


@dataclass(frozen=True)
class MLPSpec:
    hidden_size: int
    intermediate_size: int
    tsp_size: int
    activation: str = "silu"


class _Ring:
    """Async ring hops of a buffer: ``start(buf)`` sends it to the next rank and receives the
    previous rank's into a fresh buffer; ``wait()`` returns that buffer."""

    def __init__(self, group: dist.ProcessGroup, tag: int) -> None:
        self.group, self.tag, self._pending = group, tag, None

    def start(self, buf: torch.Tensor) -> None:
        recv = torch.empty_like(buf)
        self._pending = (recv, comm.ring_pass(buf, recv, self.group, tag=self.tag, async_op=True))

    def wait(self) -> torch.Tensor:
        recv, handle = self._pending
        handle.wait()
        self._pending = None
        return recv


class _TSPGatedMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec: MLPSpec, group, *weights):
        pack = FlatPack([w.shape for w in weights])
        own = pack.pack(weights)
        B, L, h = x.shape
        x2 = x.reshape(B * L, h)
        y = torch.zeros_like(x2)
        ring = _Ring(group, _WEIGHT_TAG)
        cur = own
        for step in range(spec.tsp_size):
            if step + 1 < spec.tsp_size:
                ring.start(cur)
            wg, wu, wd, *b = pack.unpack(cur)
            bg, bu = b if b else (None, None)
            m = _act(F.linear(x2, wg, bg), spec.activation) * F.linear(x2, wu, bu)
            y.addmm_(m, wd.t())
            del m
            if step + 1 < spec.tsp_size:
                cur = ring.wait()
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
        weights_ring, grads_ring = _Ring(group, _WEIGHT_TAG), _Ring(group, _GRAD_TAG)
        cur = pack.pack(weights)
        D = spec.tsp_size
        acc = None
        for step in range(D):
            if step + 1 < D:
                weights_ring.start(cur)
            wg, wu, wd, *b = pack.unpack(cur)
            bg, bu = b if b else (None, None)
            g = F.linear(x2, wg, bg)
            u = F.linear(x2, wu, bu)
            a = _act(g, spec.activation)
            dm = dy2 @ wd
            d_wd = dy2.t() @ (a * u)
            du = dm * a
            dg = dm.mul_(u).mul_(_act_grad(g, spec.activation))
            del g, u, a
            dx.addmm_(dg, wg).addmm_(du, wu)
            contrib = [dg.t() @ x2, du.t() @ x2, d_wd] + ([dg.sum(0), du.sum(0)] if b else [])
            del dg, du
            acc_in = grads_ring.wait() if step > 0 else None
            acc = pack.pack(contrib)
            if acc_in is not None:
                acc.add_(acc_in)
            if D > 1:
                grads_ring.start(acc)  # the last hop delivers the finished sum to its owner
            if step + 1 < D:
                cur = weights_ring.wait()
        if D > 1:
            acc = grads_ring.wait()
        return (dx.view(B, L, h), None, None, *pack.unpack(acc))


class TSPGatedMLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))`` with TSP: rank p owns intermediate channels
    [p*F/D, (p+1)*F/D) of gate and up and the same columns of down. Down's bias is replicated."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, intermediate_size: int, *,
                 activation: str = "silu", bias: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_seed: int | None = 0) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
        if intermediate_size % mesh.size:
            raise ValueError(f"tsp_size ({mesh.size}) must divide intermediate_size "
                             f"({intermediate_size})")
        self.mesh = mesh
        self.spec = MLPSpec(hidden_size, intermediate_size, mesh.size, activation)
        gen = None if init_seed is None else torch.Generator().manual_seed(init_seed)
        full = {n: torch.randn(shape, generator=gen) * 0.02 for n, shape in (
            ("gate_weight", (intermediate_size, hidden_size)),
            ("up_weight", (intermediate_size, hidden_size)),
            ("down_weight", (hidden_size, intermediate_size)))}
        if bias:
            full.update(gate_bias=torch.zeros(intermediate_size),
                        up_bias=torch.zeros(intermediate_size), down_bias=torch.zeros(hidden_size))
        self.load_full({k: v.to(dtype=dtype or torch.get_default_dtype(), device=device)
                        for k, v in full.items()}, _create=True)

    def load_full(self, full: dict[str, torch.Tensor], _create: bool = False) -> None:
        """Keep this rank's slices of full (Hugging Face-shaped) weights: ``gate_weight``,
        ``up_weight`` [F, h], ``down_weight`` [h, F], optional ``gate_bias``, ``up_bias``,
        ``down_bias``."""
        s = self.spec
        for name, shape in (("gate_weight", (s.intermediate_size, s.hidden_size)),
                            ("up_weight", (s.intermediate_size, s.hidden_size)),
                            ("down_weight", (s.hidden_size, s.intermediate_size))):
            if tuple(full[name].shape) != shape:
                raise ValueError(f"{name} has shape {tuple(full[name].shape)}, expected {shape} "
                                 f"for hidden_size={s.hidden_size}, "
                                 f"intermediate_size={s.intermediate_size}")
        with torch.no_grad():
            for name, tensor in full.items():
                dim = 1 if name == "down_weight" else 0
                part = tensor.clone() if name == "down_bias" else shard_slice(tensor, self.mesh, dim)
                if _create:
                    param = (replicated_parameter(part, self.mesh) if name == "down_bias"
                             else sharded_parameter(part, self.mesh, dim))
                    setattr(self, name, param)
                else:
                    local(getattr(self, name)).copy_(part)

    def full_tensors(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full Hugging Face-shaped weights (or their gradients), gathered over the group."""
        return {n: (p.grad if grads else p).full_tensor() for n, p in self.named_parameters()
                if not grads or p.grad is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if x.dim() != 3 or x.shape[-1] != s.hidden_size:
            raise ValueError(f"input of shape {tuple(x.shape)} does not match the layer: expected "
                             f"[batch, local_seq, hidden_size={s.hidden_size}]")
        names = ["gate_weight", "up_weight", "down_weight"]
        if hasattr(self, "gate_bias"):
            names += ["gate_bias", "up_bias"]
        weights = local_weights(self, names, x)
        y = _TSPGatedMLPFn.apply(x, s, self.mesh.group, *weights)
        if hasattr(self, "down_bias"):
            y = y + local_replicated(self.down_bias, self.mesh)
        return y

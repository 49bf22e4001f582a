"""RMSNorm with a replicated weight whose gradient is summed over the TSP group (every rank
normalises different tokens with the same weight), in each family's own numerics."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..distributed.mesh import TSPMesh
from ..distributed.params import REPLICATED, ShardedModule, ShardSpec, init_full, local_replicated
from .tiles import TokenTiled, norm_tile_tokens, token_tiles


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm over the last dim: normalised in float32 whatever the input
    dtype, cast back, then scaled (also the per-head q/k norm of Qwen3)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (Gemma 1-3, their q/k norms too): scaled by ``1 + weight`` in float32,
    then cast back (the weight is stored as an offset from one). A float64 model stays in
    float64 (Hugging Face's ``.float()`` would round it, and its weight gradient, to float32)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    xa = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    return (xa * (1.0 + weight.to(acc))).type_as(x)


def olmo2_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """OLMo 2's RMSNorm (its q/k norms too): normalised in float32 whatever the input dtype,
    scaled by the weight *before* the cast back (Llama casts, then scales)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32).to(dtype)


def gemma4_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm (its q/k norms too): ``x * (mean(x^2) + eps) ** -0.5`` scaled by the
    weight itself (not ``1 + weight`` as in Gemma 1-3), in float32 whatever the input dtype, then
    cast back. A float64 model stays in float64 (Hugging Face's ``.float()`` would round it)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    xa = xa * torch.pow(xa.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (xa * weight.to(acc)).type_as(x)


def l2_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Llama 4's q/k norm (``Llama4TextL2Norm``): RMS-normalised over the last dim without a
    weight (``weight`` is ignored), in float32 at least, then cast back. Hugging Face's
    ``x.float()`` rounds a float64 model to float32; here a float64 model stays in float64."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    return (xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


NORMS: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "llama": rms_norm, "gemma": gemma_rms_norm, "olmo2": olmo2_rms_norm,
    "gemma4": gemma4_rms_norm, "l2": l2_norm}
# kinds without a weight: q/k norms only (TSPAttention), never a layer's TSPRMSNorm
WEIGHTLESS = ("l2",)


def unscaled_norm(x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    """The RMSNorm of ``kind`` without a learned scale (Gemma 4's value norm): ``kind``'s own
    numerics with the weight that is the identity for it (zero for "gemma"'s offset from one,
    else one), so the result is bit for bit that norm's output times exactly 1."""
    one = x.new_full((x.shape[-1],), 0.0 if kind == "gemma" else 1.0)
    return NORMS[kind](x, one, eps)


class _TiledNorm(torch.autograd.Function):
    """A norm over ``tile`` tokens at a time that keeps only its input for the backward, which
    reruns the norm's own operations under autograd, a tile at a time. Plain autograd over a
    bf16 [S/D, h] input would keep float32 copies and bf16 intermediates about three times the
    input's size, and make as many again in its backward; at long context that is several layer
    inputs per norm (docs/design.md "Long context"). The norm acts token by token, so the output
    and the input's gradient are plain autograd's; the weight's gradient is summed over the tiles
    in float32 (float64 for a float64 model)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, kind: str, eps: float, tile: int):
        ctx.kind, ctx.eps, ctx.tile = kind, eps, tile
        ctx.save_for_backward(x, weight)
        flat = x.reshape(-1, x.shape[-1])
        out = None
        for sl in token_tiles(flat.shape[0], tile):
            y = NORMS[kind](flat[sl], weight, eps)
            if out is None:
                out = flat.new_empty(flat.shape, dtype=y.dtype)
            out[sl] = y
            del y
        return (out if out is not None else NORMS[kind](flat, weight, eps)).view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[:2]
        flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, x.shape[-1])
        dx = torch.empty_like(flat) if want_x else None
        dw = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        for sl in token_tiles(flat.shape[0], ctx.tile):
            with torch.enable_grad():
                xt = flat[sl].detach().requires_grad_(want_x)
                w = weight.detach().requires_grad_(want_w)
                y = NORMS[ctx.kind](xt, w, ctx.eps)
                wanted = [t for t in (xt, w) if t.requires_grad]
                grads = list(torch.autograd.grad(y, wanted, g[sl])) if wanted else []
            del y
            if want_x:
                dx[sl] = grads.pop(0)
            if want_w:
                dw += grads.pop(0)
        return (dx.view(x.shape) if want_x else None, dw.to(weight.dtype) if want_w else None,
                None, None, None)


class TSPRMSNorm(TokenTiled, ShardedModule):
    """RMSNorm with the Hugging Face numerics of ``kind`` (:data:`NORMS`: "llama", "gemma"
    whose weight is an offset from one, "olmo2", "gemma4"), so a parallelized model gives HF's
    numbers; only its input is kept for the backward, and it runs ``tile_tokens`` tokens at a
    time (:class:`_TiledNorm`; None: :func:`tiles.norm_tile_tokens` of the hidden size)."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, eps: float = 1e-6, kind: str = "llama",
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if kind not in NORMS or kind in WEIGHTLESS:
            raise ValueError(f"unknown RMSNorm kind {kind!r}; one of "
                             f"{sorted(set(NORMS) - set(WEIGHTLESS))}")
        self.mesh, self.eps, self.kind = mesh, eps, kind
        self.full_shapes = {"weight": (hidden_size,)}
        full = init_full(self.full_shapes, 0, dtype, device, ones=("weight",))
        if kind == "gemma":  # the identity is a zero offset
            full["weight"].zero_()
        self._create(full)

    def extra_repr(self) -> str:
        return f"{self.full_shapes['weight']}, eps={self.eps}, kind={self.kind}"

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        return REPLICATED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = local_replicated(self.weight, self.mesh)
        if not torch.is_grad_enabled():
            return NORMS[self.kind](x, weight, self.eps)
        tile = self.tile_tokens or norm_tile_tokens(x.shape[-1])
        return _TiledNorm.apply(x, weight, self.kind, self.eps, tile)

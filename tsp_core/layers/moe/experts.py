"""One expert's computation in any stored layout: views of its gate, up and down projections
(:func:`expert_views`) and its gated activation with its backward (:func:`glu`,
:func:`glu_backward`), shared by both schedules and decode."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..mlp import activate, activation_grad
from .spec import MoESpec


def glu(g: torch.Tensor, u: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """An expert's intermediate from its gate and up projections: ``act(g) * u``, or gpt-oss's
    clamped SwiGLU ``(clamp(u, -l, l) + 1) * gc * sigmoid(alpha * gc)``, gc = min(g, l)."""
    if spec.activation != "swiglu_clamped":
        return activate(g, spec.activation) * u
    gc = g.clamp(max=spec.swiglu_limit)
    return (u.clamp(-spec.swiglu_limit, spec.swiglu_limit) + 1) * (gc * torch.sigmoid(
        gc * spec.swiglu_alpha))


def glu_backward(g: torch.Tensor, u: torch.Tensor, dm: torch.Tensor, spec: MoESpec
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) of :func:`glu` given its output gradient ``dm`` (consumed: reused in place).
    A clamp passes the gradient where its input is inside the bounds, limits included, as
    torch.clamp's backward does."""
    if spec.activation != "swiglu_clamped":
        a = activate(g, spec.activation)
        du = dm * a
        del a
        return dm.mul_(u).mul_(activation_grad(g, spec.activation)), du
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

"""Block-wise flash attention of local queries against a full-sequence K/V, never materialising a
score or mask tensor larger than the kernel's own tiles.

Each local query segment (a zigzag chunk) is cut into tiles; a tile sees a few key ranges, each
either fully visible, causal on a square diagonal block, or "anticausal" (the lower edge of a
sliding window: key u visible to query v iff u >= v), which is causal once queries and keys are
both reversed. Pieces are merged by log-sum-exp; the backward calls the kernel's backward per
piece with the *merged* output and LSE, as ring attention does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

Mask = Literal["full", "causal", "anticausal"]


@dataclass(frozen=True)
class Piece:
    """Local query rows ``[q0, q1)`` against global keys ``[k0, k1)`` under ``mask``; causal and
    anticausal pieces are square, so no kernel's alignment convention for rectangles matters."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: Mask


def plan_pieces(segments: Sequence[tuple[int, ...]], seq_len: int, causal: bool,
                window: int | None) -> list[Piece]:
    """Pieces covering exactly the (query, key) pairs the attention pattern allows.

    ``segments`` are the global ``[start, end)`` ranges of the local queries in local order,
    optionally with the start of their document as a third element (packed rows: keys before it
    are never visible). ``window`` is HF's sliding window: query i sees keys j with
    i - window < j <= i.
    """
    if not causal:
        if window is not None:
            raise ValueError("a sliding window needs causal attention")
        if any(len(s) > 2 and s[2] for s in segments):
            raise ValueError("packed documents need causal attention")
        n = sum(s[1] - s[0] for s in segments)
        return [Piece(0, n, 0, seq_len, "full")]
    if window is not None and window < 1:
        raise ValueError(f"sliding window ({window}) must be at least 1")
    pieces: list[Piece] = []
    row = 0
    for seg in segments:
        start, end = seg[0], seg[1]
        first = seg[2] if len(seg) > 2 else 0  # the first key of the document
        tile = end - start if window is None else max(1, min(end - start, window - 1))
        for a in range(start, end, tile):
            t = min(tile, end - a)
            q0, q1 = row + a - start, row + a - start + t
            pieces.append(Piece(q0, q1, a, a + t, "causal"))
            if window is None:
                if a > first:
                    pieces.append(Piece(q0, q1, first, a, "full"))
                continue
            if window == 1:                 # each query sees only itself
                continue
            band0 = a - window + 1          # lower edge: t x t block, key u visible iff u >= v
            cut = max(0, first - band0)     # keys before the document do not exist: the first
            if cut < t:                     # `cut` queries then see every remaining band key
                if cut:
                    pieces.append(Piece(q0, q0 + cut, first, band0 + t, "full"))
                pieces.append(Piece(q0 + cut, q1, band0 + cut, band0 + t, "anticausal"))
            if a > max(first, band0 + t):
                pieces.append(Piece(q0, q1, max(first, band0 + t), a, "full"))
        row += end - start
    return pieces


# ------------------------------------------------------------------------------- kernels

def _kernel_fwd(q, k, v, causal: bool, scale: float):
    """Flash-class kernel: CPU flash attention (native GQA); elsewhere the memory-efficient SDPA
    kernel with K/V heads expanded for one head group (not yet verified on a GPU)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]]


def _kernel_bwd(do, q, k, v, out, lse, causal: bool, scale: float):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, scale=scale)
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    lse = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32))  # the kernel's padded layout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do, q, kr, vr, None, out, lse.contiguous(), seed, seed, 0.0, [True, True, True, False],
        causal, scale=scale)
    unflat = lambda t: t.unflatten(1, (k.shape[1], g)).sum(2)  # noqa: E731
    return dq, unflat(dk), unflat(dv)


def _piece_fwd(q, k, v, mask: Mask, scale: float):
    if mask == "anticausal":
        out, lse = _kernel_fwd(q.flip(2), k.flip(2), v.flip(2), True, scale)
        return out.flip(2), lse.flip(2)
    return _kernel_fwd(q, k, v, mask == "causal", scale)


def _piece_bwd(do, q, k, v, out, lse, mask: Mask, scale: float):
    if mask == "anticausal":
        grads = _kernel_bwd(do.flip(2), q.flip(2), k.flip(2), v.flip(2), out.flip(2),
                            lse.flip(2), True, scale)
        return tuple(g.flip(2) for g in grads)
    return _kernel_bwd(do, q, k, v, out, lse, mask == "causal", scale)


# -------------------------------------------------------------------- forward / backward

def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: list[Piece],
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, L, d] local queries; k, v [B, Hkv, S, d] full sequence (Hkv divides Hq).
    Returns the attention output [B, Hq, L, d] and its log-sum-exp [B, Hq, L]."""
    B, H, L, d = q.shape
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, H, L, d, dtype=acc_dtype, device=q.device)
    lse = torch.full((B, H, L), float("-inf"), dtype=acc_dtype, device=q.device)
    for p in pieces:
        o_p, l_p = _piece_fwd(q[:, :, p.q0:p.q1], k[:, :, p.k0:p.k1], v[:, :, p.k0:p.k1],
                              p.mask, scale)
        o_acc, l_acc = out[:, :, p.q0:p.q1], lse[:, :, p.q0:p.q1]
        l_new = torch.logaddexp(l_acc, l_p.to(acc_dtype))
        o_acc.mul_(torch.exp(l_acc - l_new).unsqueeze(-1))
        o_acc.add_(o_p.to(acc_dtype) * torch.exp(l_p.to(acc_dtype) - l_new).unsqueeze(-1))
        l_acc.copy_(l_new)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


def attention_backward(do: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, pieces: list[Piece],
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`attention_forward` w.r.t. q (local) and the packed full-sequence
    ``kv`` [2, B, Hkv, S, d]; dK and dV come back packed the same way, ready for one
    reduce-scatter."""
    dq = torch.zeros_like(q)
    dkv = torch.zeros_like(kv)
    for p in pieces:
        rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
        g_q, g_k, g_v = _piece_bwd(do[:, :, rows].contiguous(), q[:, :, rows], kv[0, :, :, keys],
                                   kv[1, :, :, keys], out[:, :, rows].contiguous(),
                                   lse[:, :, rows].contiguous(), p.mask, scale)
        dq[:, :, rows] += g_q
        dkv[0, :, :, keys] += g_k
        dkv[1, :, :, keys] += g_v
    return dq, dkv

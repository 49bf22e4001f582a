"""Block-wise flash attention of local queries against a full-sequence K/V, never materialising a
score or mask tensor larger than the kernel's own tiles.

Each local query segment (a zigzag chunk) is cut into tiles; a tile sees a few key ranges, each
either fully visible, causal on a square diagonal block, or "anticausal" (the lower edge of a
sliding window: key u visible to query v iff u >= v), which is causal once queries and keys are
both reversed. Pieces are merged by log-sum-exp in float32; the backward calls the kernel's
backward per piece with the *merged* output and LSE, as ring attention does, and sums the pieces'
gradients in float32. The piece logic is the same on every device; only the kernel differs
(:func:`kernel_for`: CPU flash, CUDA FlashAttention-2 for bf16/fp16, the memory-efficient kernel
for float32, with K/V heads expanded per piece where a kernel has no native GQA). With
soft-capped scores (``softcap``, Gemma 2) each piece runs a tiled pure-torch kernel instead (no
native flash kernel soft-caps), with the same conventions and the same merge.

Chunked local attention (Llama 4's ``attention_chunk_size``: a query sees only the keys of its
own chunk) is planned like packed documents: queries are cut at chunk boundaries and the chunk's
start is the first visible key, so no piece straddles a boundary and every piece keeps a native
kernel. Attention sinks (gpt-oss: a learned per-head logit in the softmax denominator, a column
without a value) enter once per query row, after the pieces are merged: the merged output is
scaled by ``exp(lse - lse')`` with ``lse' = logaddexp(lse, sink)``; the pieces' backward, given
that output and ``lse'``, is then already the backward of the softmax with the sink, and the sink's
own gradient is :func:`sink_backward`.

Dropout of the attention probabilities (:class:`~tsp_core.layers.dropout.AttentionDropout`, in
training with a config's ``attention_dropout``) runs every piece on the tiled math kernel: the
native kernels draw their masks from their own generators, which a piece's backward (cut into
other blocks) could not replay. Each tile's probabilities exp(s - lse_tile) are masked and scaled
by 1/(1-p); the merge by log-sum-exp stays exact because the LSE is that of the undropped
scores (Hugging Face drops after the softmax), and the backward's rowsum(dO O) is taken with the
dropped output, which is what the softmax's gradient needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .dropout import AttentionDropout

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


def chunked_segments(segments: Sequence[tuple[int, ...]], chunk: int
                     ) -> list[tuple[int, int, int]]:
    """``segments`` (as :func:`plan_pieces` takes them) cut at every chunk boundary, each part
    with the first key it may see: the start of its chunk, or of its document if later. Chunks
    count from the start of each document (a packed document is chunked as if it were alone;
    unpacked, from position 0 as Hugging Face's ``attention_chunk_size`` mask)."""
    parts: list[tuple[int, int, int]] = []
    for seg in segments:
        start, end = seg[0], seg[1]
        first = seg[2] if len(seg) > 2 else 0
        a = start
        while a < end:
            c0 = first + (a - first) // chunk * chunk   # the chunk of query a starts here
            b = min(end, c0 + chunk)
            parts.append((a, b, c0))
            a = b
    return parts


def plan_pieces(segments: Sequence[tuple[int, ...]], seq_len: int, causal: bool,
                window: int | None, chunk: int | None = None) -> list[Piece]:
    """Pieces covering exactly the (query, key) pairs the attention pattern allows.

    ``segments`` are the global ``[start, end)`` ranges of the local queries in local order,
    optionally with the start of their document as a third element (packed rows: keys before it
    are never visible). ``window`` is HF's sliding window: query i sees keys j with
    i - window < j <= i. ``chunk`` is Llama 4's ``attention_chunk_size``: query i sees only keys
    j <= i of its own chunk, j >= i // chunk * chunk (:func:`chunked_segments`: a chunk boundary
    is planned as a document boundary, so pieces wholly outside the chunk never exist).
    """
    if not causal:
        if window is not None:
            raise ValueError("a sliding window needs causal attention")
        if chunk is not None:
            raise ValueError("chunked attention (attention_chunk_size) needs causal attention")
        if any(len(s) > 2 and s[2] for s in segments):
            raise ValueError("packed documents need causal attention")
        n = sum(s[1] - s[0] for s in segments)
        return [Piece(0, n, 0, seq_len, "full")]
    if window is not None and window < 1:
        raise ValueError(f"sliding window ({window}) must be at least 1")
    if chunk is not None:
        if chunk < 1:
            raise ValueError(f"attention_chunk_size ({chunk}) must be at least 1")
        segments = chunked_segments(segments, chunk)
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

@dataclass(frozen=True)
class Kernel:
    """One attention kernel with the conventions the piece logic relies on: ``fwd(q, k, v, causal,
    scale)`` returns the output and its natural-log LSE [B, Hq, Lq] in float32 (float64 for float64
    input); ``bwd(do, q, k, v, out, lse, causal, scale)`` returns dq, dk, dv from a (merged)
    output and LSE. Without ``native_gqa`` the kernel needs as many K/V heads as query heads:
    the piece's K/V are expanded (one piece's keys, never the sequence's) and dK/dV folded back."""

    name: str
    fwd: Callable
    bwd: Callable
    native_gqa: bool


def _cpu_fwd(q, k, v, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)


def _cpu_bwd(do, q, k, v, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, out, lse, 0.0, causal, scale=scale)


def _cuda_flash_fwd(q, k, v, causal: bool, scale: float):
    """FlashAttention-2 (bf16/fp16): K/V with fewer heads than Q are used in place (GQA)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _cuda_flash_bwd(do, q, k, v, out, lse, causal: bool, scale: float):
    # no dropout: the random-state tensors are placeholders; no varlen: no cumulative lengths
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
        scale=scale)
    return dq, dk, dv


def _cuda_efficient_fwd(q, k, v, causal: bool, scale: float):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]]


def _cuda_efficient_bwd(do, q, k, v, out, lse, causal: bool, scale: float):
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    lse = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32))  # the kernel's padded layout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do, q, k, v, None, out, lse.contiguous(), seed, seed, 0.0, [True, True, True, False],
        causal, scale=scale)
    return dq, dk, dv


KERNELS = {
    "cpu": Kernel("cpu", _cpu_fwd, _cpu_bwd, native_gqa=True),
    "flash": Kernel("flash", _cuda_flash_fwd, _cuda_flash_bwd, native_gqa=True),
    "efficient": Kernel("efficient", _cuda_efficient_fwd, _cuda_efficient_bwd, native_gqa=False),
}
MATH = "math"  # the tiled pure-torch kernel below: soft-capped scores, float64 off the CPU


@dataclass(frozen=True)
class PieceDropout:
    """Attention dropout for one piece: the layer call's :class:`AttentionDropout` and where the
    piece's first query row and key sit, so that a tile's mask is that of its coordinates in the
    whole call, whichever piece or block asks (the forward's pieces and the backward's
    key blocks differ)."""

    dropout: AttentionDropout
    q0: int
    k0: int

    def keep(self, batch: int, heads: int, rows: tuple[int, int], keys: tuple[int, int],
             device: torch.device) -> torch.Tensor:
        return self.dropout.keep(batch, heads, (self.q0 + rows[0], self.q0 + rows[1]),
                                 (self.k0 + keys[0], self.k0 + keys[1]), device)


def kernel_for(q: torch.Tensor, softcap: float | None = None,
               dropout: AttentionDropout | None = None) -> str:
    """The kernel that runs a piece of ``q``'s dtype, device and head size: the CPU flash kernel
    on CPU; on CUDA FlashAttention-2 for bf16/fp16 with a head size it takes (a multiple of 8, at
    most 256), the memory-efficient kernel for float32 and other head sizes; the tiled math
    kernel for soft-capped scores (no native kernel caps), with attention dropout (a mask the
    backward can replay) and for float64 off the CPU."""
    if softcap is not None or dropout is not None:
        return MATH
    if q.device.type == "cpu":
        return "cpu"
    low = q.dtype in (torch.float16, torch.bfloat16)
    if low and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        return "flash"
    return "efficient" if low or q.dtype == torch.float32 else MATH


def _expanded(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """K/V with one head per query head if the kernel needs it (this piece's keys only)."""
    g = q.shape[1] // k.shape[1]
    if kernel.native_gqa or g == 1:
        return k, v, g
    return k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), g


def _kernel_fwd(kernel: Kernel, q, k, v, causal: bool, scale: float):
    k, v, _ = _expanded(kernel, q, k, v)
    return kernel.fwd(q, k, v, causal, scale)


def _kernel_bwd(kernel: Kernel, do, q, k, v, out, lse, causal: bool, scale: float):
    ke, ve, g = _expanded(kernel, q, k, v)
    dq, dk, dv = kernel.bwd(do, q, ke, ve, out, lse, causal, scale)
    if ke is not k:  # fold the expanded heads' gradients back onto their shared K/V head
        dk, dv = (t.unflatten(1, (k.shape[1], g)).sum(2) for t in (dk, dv))
    return dq, dk, dv


# ------------------------------------------------------------------- tiled math kernel

# Soft-capped scores (Gemma 2: s = tanh(q.k * scale / cap) * cap before the mask and softmax)
# have no native flash kernel: each piece is then computed by the tiled pure-torch kernel below,
# at most MATH_TILE queries x MATH_TILE keys (every head of the batch) at a time, merged by
# log-sum-exp, so no score tensor larger than a tile exists (docs/design.md "Memory rules"). Float64
# pieces off the CPU (no native kernel takes float64 there) run it too, uncapped.
MATH_TILE = 512


def _tiles(n: int, tile: int) -> list[tuple[int, int]]:
    return [(a, min(a + tile, n)) for a in range(0, n, tile)]


def _math_visible(mask: Mask, a: int, a1: int, b: int, b1: int, device
                  ) -> torch.Tensor | None | bool:
    """Query tile [a, a1) against key tile [b, b1) of one piece (causal and anticausal pieces are
    square, tiled the same way on both axes): False if nothing is visible, None if everything is,
    else the [tq, tk] visibility (causal: key u visible to query v iff u <= v; anticausal: u >= v).
    Every row of a tile that is not skipped sees at least one key (its diagonal)."""
    if mask == "full":
        return None
    if (mask == "causal" and b >= a1) or (mask == "anticausal" and b1 <= a):
        return False
    if (mask == "causal" and b1 <= a + 1) or (mask == "anticausal" and b >= a1 - 1):
        return None
    rows = torch.arange(a, a1, device=device)[:, None]
    cols = torch.arange(b, b1, device=device)[None]
    return cols <= rows if mask == "causal" else cols >= rows


def _math_scores(qt, kt, scale: float, softcap: float | None, visible):
    """The masked scores of one tile and, when capped, tanh(q k^T * scale / cap) (the tile's
    [B, Hkv, g, tq, tk] tanh, for the backward; else None), in the order of Hugging Face's eager
    attention: times the scale, over the cap, tanh, times the cap."""
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return t, s


def _tile_keep(drop: PieceDropout | None, q: torch.Tensor, g: int, rows: tuple[int, int],
               keys: tuple[int, int]) -> torch.Tensor | None:
    """A tile's keep mask as the math kernel's [B, Hkv, g, tq, tk] (None without dropout)."""
    if drop is None:
        return None
    B, Hq = q.shape[:2]
    keep = drop.keep(B, Hq, rows, keys, q.device)
    return keep.view(B, Hq // g, g, *keep.shape[2:])


def _dropped(p: torch.Tensor, drop: PieceDropout | None, keep: torch.Tensor | None):
    return p if drop is None else drop.dropout.apply(p, keep)


def _math_fwd(q, k, v, mask: Mask, scale: float, softcap: float | None,
              drop: PieceDropout | None = None):
    """(out, lse) of one piece by the tiled math kernel, the conventions of the native kernels:
    q [B, Hq, Lq, d], k, v [B, Hkv, Lk, d] (Hkv divides Hq); out in q's dtype, lse [B, Hq, Lq]
    natural-log, float32 (float64 for float64 input). With ``drop`` the probabilities are
    dropped (the LSE is the undropped one's)."""
    B, Hq, Lq, d = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.reshape(B, Hkv, g, Lq, d)
    out = torch.zeros(B, Hkv, g, Lq, d, dtype=acc, device=q.device)
    lse = torch.full((B, Hkv, g, Lq), float("-inf"), dtype=acc, device=q.device)
    tile = MATH_TILE
    for a, a1 in _tiles(Lq, tile):
        qt = qg[:, :, :, a:a1].to(acc)
        o_acc, l_acc = out[:, :, :, a:a1], lse[:, :, :, a:a1]
        for b, b1 in _tiles(Lk, tile):
            visible = _math_visible(mask, a, a1, b, b1, q.device)
            if visible is False:
                continue
            _, s = _math_scores(qt, k[:, :, None, b:b1].to(acc), scale, softcap, visible)
            l_t = torch.logsumexp(s, -1)
            p = _dropped(torch.exp(s - l_t.unsqueeze(-1)), drop,
                         _tile_keep(drop, q, g, (a, a1), (b, b1)))
            del s
            o_t = torch.matmul(p, v[:, :, None, b:b1].to(acc))
            del p
            l_new = torch.logaddexp(l_acc, l_t)
            o_acc.mul_(torch.exp(l_acc - l_new).unsqueeze(-1))
            o_acc.add_(o_t * torch.exp(l_t - l_new).unsqueeze(-1))
            l_acc.copy_(l_new)
    return out.view(B, Hq, Lq, d).to(q.dtype), lse.view(B, Hq, Lq)


def _math_bwd(do, q, k, v, out, lse, mask: Mask, scale: float, softcap: float | None,
              drop: PieceDropout | None = None):
    """dq, dk, dv of one piece from the *merged* output and LSE of its rows, tile by tile:
    P = exp(s - lse), dP = dO V^T, dS = P (dP - rowsum(dO O)), times the cap's derivative
    1 - tanh^2 when capped, then dQ = dS K scale, dK = dS^T Q scale, dV = P^T dO. With ``drop``
    (M the keep mask): dV = (M P / (1-p))^T dO and dP = M dO V^T / (1-p); rowsum(dO O) with the
    dropped output O is still sum_j P_j dP_j."""
    B, Hq, Lq, d = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg, dog = q.reshape(B, Hkv, g, Lq, d), do.reshape(B, Hkv, g, Lq, d)
    lseg = lse.reshape(B, Hkv, g, Lq).to(acc)
    delta = (do.to(acc) * out.to(acc)).sum(-1).view(B, Hkv, g, Lq)
    dq = torch.zeros(B, Hkv, g, Lq, d, dtype=acc, device=q.device)
    dk = torch.zeros(B, Hkv, Lk, d, dtype=acc, device=q.device)
    dv = torch.zeros(B, Hkv, Lk, d, dtype=acc, device=q.device)
    tile = MATH_TILE
    for a, a1 in _tiles(Lq, tile):
        qt, dot = qg[:, :, :, a:a1].to(acc), dog[:, :, :, a:a1].to(acc)
        for b, b1 in _tiles(Lk, tile):
            visible = _math_visible(mask, a, a1, b, b1, q.device)
            if visible is False:
                continue
            kt, vt = k[:, :, None, b:b1].to(acc), v[:, :, None, b:b1].to(acc)
            t, s = _math_scores(qt, kt, scale, softcap, visible)
            p = torch.exp(s - lseg[:, :, :, a:a1].unsqueeze(-1))
            del s
            keep = _tile_keep(drop, q, g, (a, a1), (b, b1))
            dv[:, :, b:b1] += torch.matmul(_dropped(p, drop, keep).transpose(-1, -2), dot).sum(2)
            dp = _dropped(torch.matmul(dot, vt.transpose(-1, -2)), drop, keep)
            ds = p * (dp - delta[:, :, :, a:a1].unsqueeze(-1))
            del p, dp, keep
            if t is not None:
                ds.mul_(1 - t * t)
                del t
            ds.mul_(scale)
            dq[:, :, :, a:a1] += torch.matmul(ds, kt)
            dk[:, :, b:b1] += torch.matmul(ds.transpose(-1, -2), qt).sum(2)
    return dq.view(B, Hq, Lq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _piece_fwd(q, k, v, mask: Mask, scale: float, softcap: float | None = None,
               drop: PieceDropout | None = None):
    name = kernel_for(q, softcap, None if drop is None else drop.dropout)
    if name == MATH:  # scores in float32/float64 even under autocast, as a flash kernel's
        with torch.autocast(q.device.type, enabled=False):
            return _math_fwd(q, k, v, mask, scale, softcap, drop)
    kernel = KERNELS[name]
    if mask == "anticausal":
        out, lse = _kernel_fwd(kernel, q.flip(2), k.flip(2), v.flip(2), True, scale)
        return out.flip(2), lse.flip(2)
    return _kernel_fwd(kernel, q, k, v, mask == "causal", scale)


def _piece_bwd(do, q, k, v, out, lse, mask: Mask, scale: float, softcap: float | None = None,
               drop: PieceDropout | None = None):
    name = kernel_for(q, softcap, None if drop is None else drop.dropout)
    if name == MATH:
        with torch.autocast(q.device.type, enabled=False):
            return _math_bwd(do, q, k, v, out, lse, mask, scale, softcap, drop)
    kernel = KERNELS[name]
    if mask == "anticausal":
        grads = _kernel_bwd(kernel, do.flip(2), q.flip(2), k.flip(2), v.flip(2), out.flip(2),
                            lse.flip(2), True, scale)
        return tuple(g.flip(2) for g in grads)
    return _kernel_bwd(kernel, do, q, k, v, out, lse, mask == "causal", scale)


# -------------------------------------------------------------------- forward / backward

def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: list[Piece],
                      scale: float, *, softcap: float | None = None,
                      sinks: torch.Tensor | None = None,
                      dropout: AttentionDropout | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, L, d] local queries; k, v [B, Hkv, S, d] full sequence (Hkv divides Hq).
    Returns the attention output [B, Hq, L, d] and its log-sum-exp [B, Hq, L]. ``softcap``:
    scores become ``tanh(s / softcap) * softcap`` before the mask and softmax (Gemma 2's
    attention logit soft-capping; the tiled math kernel instead of the native one). ``sinks``
    [Hq]: each query head's sink logit (gpt-oss), one more softmax column without a value, added
    once per row after the pieces are merged (:func:`add_sinks`); the LSE returned includes it.
    ``dropout``: the probabilities (never the sink's) dropped as it says, on the math kernel; the
    LSE returned is the undropped one's, which the backward needs."""
    B, H, L, d = q.shape
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, H, L, d, dtype=acc_dtype, device=q.device)
    lse = torch.full((B, H, L), float("-inf"), dtype=acc_dtype, device=q.device)
    for p in pieces:
        o_p, l_p = _piece_fwd(q[:, :, p.q0:p.q1], k[:, :, p.k0:p.k1], v[:, :, p.k0:p.k1],
                              p.mask, scale, softcap, _piece_dropout(dropout, p))
        o_acc, l_acc = out[:, :, p.q0:p.q1], lse[:, :, p.q0:p.q1]
        l_new = torch.logaddexp(l_acc, l_p.to(acc_dtype))
        o_acc.mul_(torch.exp(l_acc - l_new).unsqueeze(-1))
        o_acc.add_(o_p.to(acc_dtype) * torch.exp(l_p.to(acc_dtype) - l_new).unsqueeze(-1))
        l_acc.copy_(l_new)
    if sinks is not None:
        lse = add_sinks(out, lse, sinks)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


def _piece_dropout(dropout: AttentionDropout | None, piece: Piece) -> PieceDropout | None:
    return None if dropout is None else PieceDropout(dropout, piece.q0, piece.k0)


def _check_sinks(sinks: torch.Tensor, heads: int) -> None:
    if sinks.dim() != 1 or sinks.shape[0] != heads:
        raise ValueError(f"sinks of shape {tuple(sinks.shape)} do not match the {heads} query "
                         f"heads: pass one logit per query head, [{heads}]")


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Add each head's sink logit to the softmax of merged rows, once per row: scales ``out``
    [B, H, L, d] in place by ``exp(lse - lse')`` and returns ``lse' = logaddexp(lse, sink)``
    [B, H, L] (a row that sees no key keeps a zero output and gets ``lse' = sink``)."""
    _check_sinks(sinks, out.shape[1])
    with_sink = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    out.mul_(torch.exp(lse - with_sink).unsqueeze(-1).to(out.dtype))
    return with_sink


def sink_backward(do: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  sinks: torch.Tensor) -> torch.Tensor:
    """Gradient of the sinks [H] from the output gradient ``do``, the output ``out`` and the LSE
    ``lse`` (sink included) of :func:`attention_forward`. The sink is a softmax column with
    probability p = exp(sink - lse) and no value, so its score gradient is p (0 - rowsum(dO O)):
    d sink_h = -sum over rows (and the batch) of p * rowsum(dO O). Summed in float32 (float64 for
    float64 input), returned in the sinks' dtype. The pieces' backward needs nothing more: given
    this ``out`` and ``lse``, its P and rowsum(dO O) are already those of the softmax with the
    sink."""
    _check_sinks(sinks, out.shape[1])
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    delta = (do.to(acc) * out.to(acc)).sum(-1)                        # [B, H, L]
    p = torch.exp(sinks.to(acc)[None, :, None] - lse.to(acc))
    return (-(p * delta).sum((0, 2))).to(sinks.dtype)


def key_blocks(piece: Piece) -> list[Piece]:
    """A full piece cut along its keys into blocks of at most as many keys as it has queries
    (causal and anticausal pieces are square already). The kernel's backward returns dK/dV over
    the call's keys in the input dtype; uncut, rank 0's second zigzag chunk against its prefix
    would return nearly the whole sequence's, beside the accumulator that already covers it
    (docs/memory.md "The attention backward's floor")."""
    n = piece.q1 - piece.q0
    if piece.mask != "full" or piece.k1 - piece.k0 <= n:
        return [piece]
    return [Piece(piece.q0, piece.q1, k, min(k + n, piece.k1), "full")
            for k in range(piece.k0, piece.k1, n)]


def attention_backward(do: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, pieces: list[Piece],
                       scale: float, *, softcap: float | None = None,
                       dkv: torch.Tensor | None = None,
                       halfway: Callable[[], None] | None = None,
                       dropout: AttentionDropout | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`attention_forward` (with the same ``softcap`` and ``dropout``) w.r.t.
    q (local) and the packed full-sequence ``kv`` [2, B, Hkv, S, d] (with sinks, ``out`` and
    ``lse`` are the forward's, sink included, and the sinks' own gradient is
    :func:`sink_backward`). Every
    piece's gradients are summed in float32 (float64 for float64 input) whatever the input dtype,
    as the forward merges its outputs: dQ comes back in q's dtype, dK/dV as that float32
    accumulator, packed like ``kv`` (added into ``dkv`` when given: a key/value head shared by
    several rounds), for the caller to cast once before its reduce-scatter. Full pieces run in
    :func:`key_blocks`. ``halfway`` is called once, when half of the (query, key) pairs are
    done: the caller's moment to retire one collective and start the next while the other half
    computes (docs/design.md "Overlap")."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = q.new_zeros(q.shape, dtype=acc)
    if dkv is None:
        dkv = kv.new_zeros(kv.shape, dtype=acc)
    elif dkv.dtype != acc or dkv.shape != kv.shape:
        raise ValueError(f"dkv accumulator {dkv.dtype} {tuple(dkv.shape)} does not match "
                         f"{acc} {tuple(kv.shape)}")
    blocks = [b for p in pieces for b in key_blocks(p)]
    work = [(b.q1 - b.q0) * (b.k1 - b.k0) for b in blocks]
    done, half = 0, sum(work) / 2
    for p, w in zip(blocks, work):
        rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
        g_q, g_k, g_v = _piece_bwd(do[:, :, rows].contiguous(), q[:, :, rows], kv[0, :, :, keys],
                                   kv[1, :, :, keys], out[:, :, rows].contiguous(),
                                   lse[:, :, rows].contiguous(), p.mask, scale, softcap,
                                   _piece_dropout(dropout, p))
        dq[:, :, rows] += g_q
        dkv[0, :, :, keys] += g_k
        dkv[1, :, :, keys] += g_v
        del g_q, g_k, g_v
        done += w
        if halfway is not None and done >= half:
            halfway()
            halfway = None
    if halfway is not None:  # no pieces (no visible pair)
        halfway()
    return dq.to(q.dtype), dkv

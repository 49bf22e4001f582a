"""Part (a): the flash pieces (``tsp_core.layers.flash``) forward and backward against a dense
float64 reference with an explicit mask, for every mask kind, zigzag degree, sliding window, packed
documents, GQA and MQA, in each low-precision dtype the device's kernel runs.

The inputs are drawn in float64, rounded to the dtype under test, and the reference is computed
from the *rounded* values in float64: the error measured is the kernel's and the merge's, not the
rounding of the inputs. Error = max |a - ref| / max |ref| for out, dq, dk and dv; a case's figure
is the largest over the four and over every rank of the case.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from ...distributed.chunks import row_segments
from ...layers import flash
from .common import Check, failure, rel_err, within

DTYPES = ("float32", "bfloat16", "float16")

# Tolerances on max|a - ref| / max|ref|, from the errors measured on the CPU flash kernel (torch
# 2.13, every case and rank; docs/gpu.md) with a margin of 2.5-10x. float32: accumulation-order
# rounding only, at most 1.1e-6 seen. bfloat16 (8 mantissa bits, unit roundoff 2^-9 = 2e-3):
# outputs and gradients are rounded to bf16 and dQ/dK/dV of several pieces are summed in bf16, a
# few ulps of the largest entry: at most 7.7e-3 seen. float16 (11 bits, 8x finer): at most 1.0e-3
# seen. A GPU kernel may differ; a failure there names the worst tensor in the note.
TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


@dataclass(frozen=True)
class FlashCase:
    """``anticausal``: one square piece where key u is visible to query v iff u >= v (the lower
    edge of a sliding window) instead of a piece plan."""

    name: str
    size: int = 1
    causal: bool = True
    window: int | None = None
    docs: tuple[int, ...] | None = None
    heads: int = 4
    kv_heads: int = 4
    anticausal: bool = False


def cases(seq: int) -> list[FlashCase]:
    """Every case at sequence length ``seq`` (a multiple of 64: documents of seq/8 at D = 4)."""
    docs = (seq // 4, seq // 2, seq // 8, seq // 8)
    window = seq // 8 + 3  # not a multiple of a chunk: tiles cut across chunk borders
    return [FlashCase("mask.causal"), FlashCase("mask.full", causal=False),
            FlashCase("mask.anticausal", anticausal=True),
            FlashCase("zigzag.D2", 2), FlashCase("zigzag.D4", 4), FlashCase("zigzag.D8", 8),
            FlashCase("window", 4, window=window), FlashCase("packed", 4, docs=docs),
            FlashCase("packed.window", 2, window=window, docs=docs),
            FlashCase("gqa", 2, heads=8, kv_heads=2), FlashCase("mqa", 4, heads=4, kv_heads=1,
                                                               window=window)]


def shapes(device: str) -> dict[str, int]:
    """Small on CPU (seconds for every case); on a GPU a real head size and a longer sequence."""
    return dict(batch=2, seq=2048, head_dim=128) if device == "cuda" else \
        dict(batch=1, seq=256, head_dim=32)


def supported_dtypes(device: str) -> list[str]:
    """The dtypes of :data:`DTYPES` the device's kernel runs. On CUDA every one must run (a
    failure there is a failed check, not a skip); on CPU a dtype the CPU flash kernel refuses is
    left out and the run prints which ran."""
    if device == "cuda":
        return list(DTYPES)
    ok = []
    for name in DTYPES:
        q = torch.randn(1, 1, 8, 8, dtype=getattr(torch, name))
        try:
            out, lse = flash.attention_forward(q, q, q, flash.plan_pieces([(0, 8)], 8, True, None),
                                               0.5)
            flash.attention_backward(out, q, torch.stack([q, q]), out, lse,
                                     flash.plan_pieces([(0, 8)], 8, True, None), 0.5)
            ok.append(name)
        except (RuntimeError, NotImplementedError):
            pass
    return ok


def _plan(case: FlashCase, seq: int, rank: int) -> tuple[list[int], list[flash.Piece]]:
    """Global positions of the rank's queries, in local order, and their pieces."""
    if case.anticausal:
        return list(range(seq)), [flash.Piece(0, seq, 0, seq, "anticausal")]
    segs = row_segments(case.docs or (seq,), rank, case.size, "zigzag")
    rows = [t for a, b, _ in segs for t in range(a, b)]
    return rows, flash.plan_pieces(segs, seq, case.causal, case.window)


def visible(case: FlashCase, rows: list[int], seq: int, device: str) -> torch.Tensor:
    """The [L, S] mask written from the definition, independent of the piece plan."""
    i = torch.tensor(rows, device=device)[:, None]
    j = torch.arange(seq, device=device)[None]
    if case.anticausal:
        return j >= i
    vis = torch.ones(len(rows), seq, dtype=torch.bool, device=device)
    if case.docs is not None:
        doc_of = torch.repeat_interleave(torch.arange(len(case.docs), device=device),
                                         torch.tensor(case.docs, device=device))
        vis &= doc_of[i] == doc_of[j]
    if case.causal:
        vis &= j <= i
    if case.window is not None:
        vis &= j > i - case.window
    return vis


def dense(q, k, v, vis: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain attention in float64 with the explicit mask, K/V heads repeated for GQA/MQA."""
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    return torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ v.repeat_interleave(g, 1)


def _errors(case: FlashCase, rank: int, dtype: torch.dtype, device: str,
            shape: dict[str, int], gen: torch.Generator) -> dict[str, float]:
    B, seq, d = shape["batch"], shape["seq"], shape["head_dim"]
    rows, pieces = _plan(case, seq, rank)
    scale = d ** -0.5

    def draw(*size: int) -> torch.Tensor:  # float64 values exactly representable in ``dtype``
        t = torch.randn(*size, generator=gen, dtype=torch.float64)
        return t.to(dtype).to(device)

    q, k, v = draw(B, case.heads, len(rows), d), draw(B, case.kv_heads, seq, d), \
        draw(B, case.kv_heads, seq, d)
    do = draw(B, case.heads, len(rows), d)
    out, lse = flash.attention_forward(q, k, v, pieces, scale)
    dq, dkv = flash.attention_backward(do, q, torch.stack([k, v]), out, lse, pieces, scale)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = dense(q64, k64, v64, visible(case, rows, seq, device), scale)
    grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    return {"out": rel_err(out, ref.detach()), "dq": rel_err(dq, grads[0]),
            "dk": rel_err(dkv[0], grads[1]), "dv": rel_err(dkv[1], grads[2])}


def check_case(case: FlashCase, dtype_name: str, device: str,
               shape: dict[str, int] | None = None) -> Check:
    """One case in one dtype, every rank of its group: the largest of the four errors."""
    name = f"a.flash.{case.name}.{dtype_name}"
    shape = shape or shapes(device)
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    try:
        worst: dict[str, float] = {}
        for rank in range(1 if case.anticausal else case.size):
            for key, err in _errors(case, rank, getattr(torch, dtype_name), device, shape,
                                    gen).items():
                worst[key] = max(worst.get(key, 0.0), err)
    except Exception as e:  # noqa: BLE001 - a kernel that raises is a failed check
        return failure(name, e)
    what = max(worst, key=worst.get)
    return within(name, worst[what], TOLERANCES[dtype_name], unit="max|err|/max|ref|",
                  note=f"worst: {what}; " + ", ".join(f"{k} {v:.2g}" for k, v in worst.items()),
                  detail={"errors": worst, "ranks": 1 if case.anticausal else case.size,
                          **shape})


def run(device: str, log=print) -> list[Check]:
    """Every case in every dtype the device runs."""
    dtypes = supported_dtypes(device)
    shape = shapes(device)
    log(f"(a) flash pieces on {device}: dtypes {', '.join(dtypes)}"
        + ("" if len(dtypes) == len(DTYPES) else
           f" (not run: {', '.join(d for d in DTYPES if d not in dtypes)}: refused by the "
           f"{device} flash kernel)") + f"; shapes {shape}")
    return [check_case(case, dt, device, shape) for dt in dtypes for case in cases(shape["seq"])]

"""NF4 base weights (QLoRA) on the TSP schedules (docs/lora.md "QLoRA"; bytes in docs/design.md
"QLoRA").

bitsandbytes quantizes a weight [out, in] as its row-major flattening cut into blocks of
``blocksize`` (64) elements: two 4-bit codes per byte and one float32 ``absmax`` per block. A TSP
shard whose elements are whole blocks of that flattening (rows whose count times ``in`` is a
multiple of the block size; or columns whose start and width are multiples of it) is a slice of
the packed bytes and of ``absmax``: :func:`shard_of` cuts it, and dequantizing it with
bitsandbytes' own kernel gives the full weight's slice bit for bit (each element is its code's
NF4 value times its block's absmax).

A rank keeps its shard packed (:class:`NF4Weight`, in the projection's place in the TSP module,
with no parameter: the base is frozen). The schedule takes it as an :class:`NF4Shard`; a round
(or ring step) moves the packed bytes and absmax in one uint8 buffer (:class:`NF4Pack`, chosen
by :func:`pack_of` when a shard is quantized, in place of the float
:class:`~tsp_core.distributed.flat_pack.FlatPack`) and dequantizes them on arrival. Nothing else
in the schedules knows about quantization."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..distributed.flat_pack import FlatPack
from ..distributed.params import ShardSpec, local


def dequantize(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int,
               shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes' own NF4 dequantization (the kernel its ``Linear4bit`` forward and backward
    call) of ``packed`` codes with ``absmax`` per block, as a [shape] tensor of ``dtype``."""
    import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)

    return torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, blocksize, "nf4",
                                                          list(shape), dtype)


@dataclass(frozen=True)
class NF4Shard:
    """One rank's NF4 shard of a weight as a schedule takes it: the packed codes (uint8, two a
    byte), one float32 absmax per block, the shard's dequantized ``shape`` and ``dtype``."""

    packed: torch.Tensor
    absmax: torch.Tensor
    shape: torch.Size
    blocksize: int
    dtype: torch.dtype

    def to(self, dtype: torch.dtype) -> NF4Shard:
        """Dequantized into ``dtype`` (bitsandbytes dequantizes into the compute dtype)."""
        return replace(self, dtype=dtype)

    def dequantize(self, packed: torch.Tensor | None = None,
                   absmax: torch.Tensor | None = None) -> torch.Tensor:
        """This shard's weight, or one of the same shape from another rank's bytes."""
        return dequantize(self.packed if packed is None else packed,
                          self.absmax if absmax is None else absmax, self.blocksize,
                          self.shape, self.dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class NF4Pack:
    """One uint8 buffer for a round's weights when some are NF4 shards: every float tensor (a
    bias, the absmax of each shard) and then every shard's packed codes, as raw bytes, widest
    elements first so that each float segment starts aligned (no padding). :meth:`unpack`
    returns the weights in order, NF4 shards dequantized: the schedules compute with them as with
    :class:`FlatPack`'s. The bytes a round moves are ``numel``: the packed shards, their
    absmax and any float tensor."""

    def __init__(self, weights: Sequence[torch.Tensor | NF4Shard]) -> None:
        self.like = list(weights)
        self.shapes = [torch.Size(w.shape) for w in weights]
        # (weight index, part: "tensor" / "absmax" / "packed", dtype, elements)
        parts = []
        for i, w in enumerate(weights):
            if isinstance(w, NF4Shard):
                parts += [(i, "absmax", w.absmax.dtype, w.absmax.numel()),
                          (i, "packed", torch.uint8, w.packed.numel())]
            else:
                parts.append((i, "tensor", w.dtype, w.numel()))
        self.parts = sorted(parts, key=lambda p: -p[2].itemsize)  # stable: weight order within
        self.sizes = [p[2].itemsize * p[3] for p in self.parts]
        self.numel = sum(self.sizes)

    def pack(self, weights: Sequence[torch.Tensor | NF4Shard]) -> torch.Tensor:
        pieces = []
        for i, part, _, _ in self.parts:
            w = weights[i]
            pieces.append(_bytes(w if part == "tensor" else getattr(w, part)))
        return torch.cat(pieces)

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        found: dict[tuple[int, str], torch.Tensor] = {}
        for (i, part, dtype, _), piece in zip(self.parts, flat.split(self.sizes)):
            found[i, part] = piece.view(dtype)
        out = []
        for i, w in enumerate(self.like):
            if isinstance(w, NF4Shard):
                out.append(w.dequantize(found[i, "packed"], found[i, "absmax"]))
            else:
                out.append(found[i, "tensor"].view(self.shapes[i]))
        return out


def pack_of(weights: Sequence[torch.Tensor | NF4Shard]) -> FlatPack | NF4Pack:
    """The pack a round's (or ring step's) weights travel in: :class:`NF4Pack` when one of them
    is an NF4 shard, else the float :class:`FlatPack`."""
    if any(isinstance(w, NF4Shard) for w in weights):
        return NF4Pack(weights)
    return FlatPack([w.shape for w in weights])


def tensors_only(items: Sequence[object]) -> tuple[list[torch.Tensor | None], list[object]]:
    """(``items`` with None for every non-tensor, the non-tensors with None for every tensor):
    what a schedule's ``save_for_backward`` takes, and what it keeps on ``ctx`` beside it (an
    NF4 shard is no tensor; its frozen bytes need no autograd bookkeeping)."""
    return ([t if isinstance(t, torch.Tensor) else None for t in items],
            [None if isinstance(t, torch.Tensor) else t for t in items])


def restored(saved: Sequence[torch.Tensor | None], kept: Sequence[object]) -> list[object]:
    """The items :func:`tensors_only` split, back in their order."""
    return [k if k is not None else s for s, k in zip(saved, kept)]


class BlocksStraddle(NotImplementedError):
    """A shard of a quantized weight does not hold whole quantization blocks."""


def block_range(spec: ShardSpec, shape: tuple[int, int], blocksize: int, what: str) -> None:
    """Raise :class:`BlocksStraddle` unless the shard ``spec`` of an [out, in] weight ``shape``
    holds whole blocks of ``blocksize`` elements of its row-major flattening (then its packed
    bytes and absmax are a slice of the full ones, :func:`shard_of`)."""
    rows, cols = shape
    if spec.dim is None or spec.length != spec.local_len:
        raise BlocksStraddle(f"{what}: a quantized weight must be sharded evenly by rows or "
                             f"columns (its shard {spec} is not)")
    if spec.dim == 0:
        first, count = spec.start * cols, spec.length * cols
        whole = first % blocksize == 0 and count % blocksize == 0
        where = (f"rows [{spec.start}, {spec.start + spec.length}) of {cols} columns are "
                 f"elements [{first}, {first + count})")
    else:  # row i holds elements [i cols + start, i cols + start + length)
        whole = not (cols % blocksize or spec.start % blocksize or spec.length % blocksize)
        where = (f"columns [{spec.start}, {spec.start + spec.length}) of rows of {cols} "
                 f"elements")
    if not whole:
        raise BlocksStraddle(
            f"{what}: this rank's shard, {where}, does not hold whole NF4 blocks of {blocksize} "
            f"elements, so its packed bytes are no slice of the quantized weight {tuple(shape)}; "
            f"use a tsp_size that cuts the weight at multiples of {blocksize} elements "
            f"(docs/lora.md \"QLoRA\")")


def shard_of(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int],
             blocksize: int, spec: ShardSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (packed codes, absmax) of a full quantized [out, in] weight under ``spec``
    (checked by :func:`block_range`): contiguous copies, rows or columns."""
    rows, cols = shape
    if spec.dim == 0:  # elements [first, first + count) of the flattening
        first, count = spec.start * cols, spec.length * cols
        return (packed.reshape(-1)[first // 2:(first + count) // 2].clone(),
                absmax.reshape(-1)[first // blocksize:(first + count) // blocksize].clone())
    cut = slice(spec.start, spec.start + spec.length)
    return (packed.reshape(rows, cols // 2)[:, cut.start // 2:cut.stop // 2].reshape(-1).clone(),
            absmax.reshape(rows, cols // blocksize)[:, cut.start // blocksize:cut.stop // blocksize]
            .reshape(-1).clone())


class NF4Weight(nn.Module):
    """A quantized projection's weight holder in a TSP module (in place of its float
    ``WeightHolder``): this rank's shard packed (``weight``, uint8, two codes a byte, as
    bitsandbytes' ``Params4bit``) and its ``weight_absmax`` (float32, one per block), both
    buffers that ``state_dict`` does not hold (the base is frozen and not saved, as PEFT saves
    adapters only); a float bias, if any, stays a frozen parameter beside them.
    :meth:`schedule_shard` is what the schedules take in the weight's place."""

    def __init__(self, packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int],
                 blocksize: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", packed, persistent=False)
        self.register_buffer("weight_absmax", absmax, persistent=False)
        self.shape, self.blocksize, self.dtype = torch.Size(shape), blocksize, dtype

    def extra_repr(self) -> str:
        return (f"nf4 shard {tuple(self.shape)}, blocksize={self.blocksize}, "
                f"{self.weight.numel() + 4 * self.weight_absmax.numel()} bytes")

    def schedule_shard(self, name: str) -> NF4Shard | torch.Tensor:
        """The shard of ``name`` ("weight"; a bias is its float local tensor) for a schedule."""
        if name != "weight":
            return local(getattr(self, name))
        return NF4Shard(self.weight, self.weight_absmax, self.shape, self.blocksize, self.dtype)

    def dequantized(self) -> torch.Tensor:
        """This rank's shard as a float tensor (a full copy: for checks, not for the rounds)."""
        return self.schedule_shard("weight").dequantize()

"""Which tokens each rank of a TSP group owns, and how to go between local and full sequences.

Zigzag (default) cuts the padded sequence into 2D equal chunks and gives rank p chunks p and
2D-1-p, which balances causal attention work exactly. Contiguous gives rank p the p-th of D equal
pieces (for non-causal models). Every function here is pure: no collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..distributed import metrics
from ..distributed.chunks import (
    check_seq_len,
    local_segments,
    num_chunks,
    rank_chunks,
    row_segments,
)

if TYPE_CHECKING:
    from ..distributed.mesh import TSPMesh

IGNORE_INDEX = -100


def shard_sequence(x: torch.Tensor, rank: int, size: int, dim: int = 1,
                   layout: str = "zigzag", docs: Sequence[int] | None = None) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (a copy, so the full tensor can be freed)."""
    segs = local_segments(x.shape[dim], rank, size, layout, docs)
    return torch.cat([x.narrow(dim, a, b - a) for a, b in segs], dim=dim)


def unshard_sequence(gathered: torch.Tensor, size: int, dim: int = 1,
                     layout: str = "zigzag") -> torch.Tensor:
    """Full sequence order from the rank-order concatenation of every rank's local tokens (what an
    all-gather along ``dim`` returns)."""
    c = check_seq_len(gathered.shape[dim], size, layout)
    pieces: list[torch.Tensor | None] = [None] * num_chunks(size, layout)
    i = 0
    for r in range(size):
        for k in rank_chunks(r, size, layout):
            pieces[k] = gathered.narrow(dim, i * c, c)
            i += 1
    return torch.cat(pieces, dim=dim)


def to_rank_order(full: torch.Tensor, size: int, dim: int = 1,
                  layout: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`unshard_sequence`: concatenation of every rank's local tokens in rank
    order (what a reduce-scatter along ``dim`` expects)."""
    return torch.cat([shard_sequence(full, r, size, dim, layout) for r in range(size)], dim=dim)


def position_ids(seq_len: int, rank: int, size: int, layout: str = "zigzag",
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of the local tokens, shape [seq_len / size]."""
    return torch.cat([torch.arange(a, b, device=device)
                      for a, b in local_segments(seq_len, rank, size, layout)])


def padded_length(seq_len: int, size: int, layout: str = "zigzag") -> int:
    """Smallest length >= seq_len that splits evenly over the group."""
    n = num_chunks(size, layout)
    return -(-seq_len // n) * n


def pad_to_multiple(x: torch.Tensor, size: int, value: int | float, dim: int = 1,
                    layout: str = "zigzag") -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` with ``value`` so that it splits evenly."""
    extra = padded_length(x.shape[dim], size, layout) - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets on the full sequence: ``out[:, i] = labels[:, i+1]``, last = ignore."""
    out = labels.new_full(labels.shape, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "cu_seqlens")


def document_lengths(batch: dict[str, Any], seq: int, rows: int) -> list[list[int]]:
    """Each row's document lengths: from ``cu_seqlens`` (one 1-D tensor for a single row, or one
    per row), from ``position_ids`` that restart at 0 at each document (what transformers'
    DataCollatorWithFlattening produces), else one document per row."""
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"]
        per_row = [cu] if torch.is_tensor(cu) and cu.dim() == 1 else list(cu)
        if len(per_row) != rows:
            raise ValueError(f"cu_seqlens describes {len(per_row)} rows, input_ids has {rows}")
        out = []
        for r, c in enumerate(per_row):
            c = [int(v) for v in c]
            if len(c) < 2 or c[0] != 0 or c[-1] != seq:
                raise ValueError(f"cu_seqlens of row {r} must start at 0 and end at the row "
                                 f"length ({seq}), got {c}")
            if any(b <= a for a, b in zip(c, c[1:])):
                raise ValueError(f"cu_seqlens of row {r} must strictly increase, got {c}")
            out.append([b - a for a, b in zip(c, c[1:])])
        return out
    if "position_ids" not in batch:
        return [[seq] for _ in range(rows)]
    out = []
    for r, p in enumerate(batch["position_ids"].tolist()):
        if p[0] != 0:
            raise ValueError(f"position_ids of row {r} start at {p[0]}: every document (or the "
                             f"whole row) must start at position 0")
        for i in range(1, seq):
            if p[i] != 0 and p[i] != p[i - 1] + 1:
                raise ValueError(f"position_ids of row {r} go from {p[i - 1]} to {p[i]} at index "
                                 f"{i}: within a document they count up by 1, and a new document "
                                 f"restarts at 0")
        starts = [i for i, v in enumerate(p) if v == 0] + [seq]
        out.append([b - a for a, b in zip(starts, starts[1:])])
    return out


_PRIME = 2**31 - 1                      # a Mersenne prime: products of residues fit in int64
_BASES = (1_000_003, 2_654_435_761 % _PRIME)
_POWERS: dict[tuple[str, int], torch.Tensor] = {}


def _powers(n: int, base: int, device: torch.device) -> torch.Tensor:
    """``base ** i mod p`` for i in [0, n) (int64, on ``device``), by repeated squaring; the table
    is kept per device and base, grown to the longest tensor seen."""
    key = (str(device), base)
    have = _POWERS.get(key)
    if have is None or have.numel() < n:
        size = 1 << max(n - 1, 1).bit_length()
        i = torch.arange(size, device=device)
        out, b, bit = torch.ones(size, dtype=torch.long, device=device), base, 0
        while (1 << bit) < size:
            out = torch.where((i >> bit) & 1 == 1, out * b % _PRIME, out)
            b, bit = b * b % _PRIME, bit + 1
        _POWERS[key] = have = out
    return have[:n]


def _row_hash(x: torch.Tensor, base: int) -> torch.Tensor:
    """``sum_i x[r, i] * base^i mod p`` of each row of the 2-D integer tensor ([rows] int64)."""
    x = x.to(torch.long).remainder(_PRIME)
    return (x * _powers(x.shape[1], base, x.device) % _PRIME).sum(1) % _PRIME


def row_fingerprints(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 62-bit hash per row ([rows] int64) of integer tensors [rows, ...], their shapes
    included: two polynomial hashes mod 2^31-1 with different bases, in integer arithmetic only,
    so the same in every process (unlike Python's ``hash`` of strings, salted per process)."""
    rows, device = tensors[0].shape[0], tensors[0].device
    shapes = [len(tensors)] + [v for t in tensors for v in (t.dim(), *t.shape[1:])]
    head = torch.tensor(shapes, dtype=torch.long, device=device).expand(rows, -1)
    parts = []
    for base in _BASES:
        per = torch.stack([_row_hash(t.reshape(rows, -1), base) for t in tensors], dim=1)
        parts.append(_row_hash(torch.cat([head, per], dim=1), base))
    return parts[0] * 2**31 + parts[1]


def batch_fingerprint(rows: torch.Tensor) -> torch.Tensor:
    """One 62-bit hash (0-d int64) of a batch from its :func:`row_fingerprints`, row order and
    count included."""
    halves = torch.stack([rows >> 31, rows & (2**31 - 1)], dim=-1).reshape(1, -1)
    return row_fingerprints([halves])[0]


def shard_batch(batch: dict[str, Any], mesh: TSPMesh, *,
                ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """This rank's part of a full-sequence batch (identical on every rank of the TSP group).

    Returns ``input_ids``, ``position_ids`` (global, or per document for packed rows),
    ``shift_labels`` (when ``labels`` is given: shifted before sharding, so no rank needs its
    neighbour's first token, and never across a document boundary), ``attention_mask`` (when
    given, or when this function pads: 0 on its padding), ``tsp_docs`` ([batch, documents]: each
    row's padded document lengths, which the model's attention follows), ``tsp_rope_len``
    ([batch]: each row's longest document; the maximum is ``max(position_ids) + 1`` of the
    unmodified model on the whole batch, which rotary embeddings whose frequencies depend on the
    length need) and ``tsp_fingerprint`` ([batch]: a hash of each full row; the model compares
    the batch's over the TSP group, so ranks given different batches raise).

    Each document is padded at its end to a multiple of 2*D (zigzag) or D (contiguous) and cut into
    chunks dealt out like a whole sequence, which keeps causal work balanced for any mix of
    lengths; rows are padded to one length with a trailing padding document. Padded positions are
    ignored by the loss and masked out. Packed rows are given by ``position_ids`` that restart at 0
    at each document (transformers' DataCollatorWithFlattening) or by ``cu_seqlens``.
    """
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise ValueError(f"shard_batch does not know how to shard {unknown}; it takes "
                         f"{list(BATCH_KEYS)} (full-sequence tensors of shape [batch, seq])")
    if "input_ids" not in batch:
        raise ValueError("shard_batch needs 'input_ids' of shape [batch, seq]")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [batch, seq], got {tuple(ids.shape)}")
    size, rank, layout = mesh.size, mesh.rank, mesh.layout
    rows, seq = ids.shape
    for key in ("labels", "attention_mask", "position_ids"):
        if key in batch and tuple(batch[key].shape) != tuple(ids.shape):
            raise ValueError(f"{key} has shape {tuple(batch[key].shape)} but input_ids has "
                             f"{tuple(ids.shape)}; pass full-sequence tensors of the same shape")
    docs = document_lengths(batch, seq, rows)
    packed = any(len(d) > 1 for d in docs)
    if not packed and seq < 2 * size:
        raise ValueError(f"sequence length ({seq}) is shorter than 2*tsp_size ({2 * size}): every "
                         f"rank needs tokens of its own; use a smaller tsp_size or longer "
                         f"sequences")
    if "attention_mask" in batch and not packed:
        mask = batch["attention_mask"]
        holes = (mask[:, 1:] > mask[:, :-1]).any(dim=1).nonzero().flatten().tolist()
        if holes:
            raise ValueError(f"attention_mask rows {holes} have a 0 before a 1 (left padding or "
                             f"holes); TSP's causal attention supports right padding only: pad on "
                             f"the right (tokenizer.padding_side = 'right')")

    # every document padded to a multiple of the chunk count, rows to one length
    n = num_chunks(size, layout)
    padded = [[-(-d // n) * n for d in row] for row in docs]
    total = max(sum(row) for row in padded)
    for row in padded:
        if sum(row) < total:
            row.append(total - sum(row))  # a padding document
    source = torch.full((rows, total), -1, dtype=torch.long)
    positions = torch.empty((rows, total), dtype=torch.long)
    last_token = torch.zeros((rows, seq), dtype=torch.bool)
    for r in range(rows):
        src = dst = 0
        for j, pad_len in enumerate(padded[r]):
            d = docs[r][j] if j < len(docs[r]) else 0
            source[r, dst:dst + d] = torch.arange(src, src + d)
            positions[r, dst:dst + pad_len] = torch.arange(pad_len)
            if d:
                last_token[r, src + d - 1] = True
            src, dst = src + d, dst + pad_len
    index = torch.stack([torch.cat([torch.arange(a, b) for a, b, _ in
                                    row_segments(padded[r], rank, size, layout)])
                         for r in range(rows)]).to(ids.device)
    source, positions = source.to(ids.device), positions.to(ids.device)

    def local(x: torch.Tensor, pad: int) -> torch.Tensor:
        full = torch.where(source >= 0, x.gather(1, source.clamp(min=0)), pad)
        return full.gather(1, index)

    out = {"input_ids": local(ids, 0), "position_ids": positions.gather(1, index)}
    if "labels" in batch:
        shifted = shift_labels(batch["labels"], ignore_index)
        shifted[last_token.to(shifted.device)] = ignore_index  # never across documents
        out["shift_labels"] = local(shifted, ignore_index)
    if "attention_mask" in batch:
        out["attention_mask"] = local(batch["attention_mask"], 0)
    elif bool((source < 0).any()):  # tokens of this function's padding, marked as such for sums
        out["attention_mask"] = local(torch.ones_like(ids), 0)  # over tokens (MoE's aux loss)
    width = max(len(row) for row in padded)
    out["tsp_docs"] = torch.tensor([row + [0] * (width - len(row)) for row in padded],
                                   dtype=torch.long, device=ids.device)
    # per row, like every entry (frameworks infer the batch size from any tensor of a batch)
    out["tsp_rope_len"] = torch.tensor([max(row) for row in docs], device=ids.device)
    # the content that decides every rank's tokens: ids, labels, mask, and the positions as
    # document lengths (the same whether they came as position_ids or cu_seqlens)
    given = [k for k in ("labels", "attention_mask") if k in batch]
    deep = max(len(row) for row in docs)
    meta = torch.tensor([[BATCH_KEYS.index(k) for k in given] + row + [0] * (deep - len(row))
                         for row in docs], device=ids.device)
    out["tsp_fingerprint"] = row_fingerprints([meta, ids] + [batch[k].to(ids.device)
                                                             for k in given])
    metrics.count_tokens(ids.numel(), out["input_ids"].numel())
    return out

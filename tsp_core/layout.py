"""Which tokens each rank of a TSP group owns, and how to go between local and full sequences.

Zigzag (default) cuts the padded sequence into 2D equal chunks and gives rank p chunks p and
2D-1-p, which balances causal attention work exactly. Contiguous gives rank p the p-th of D equal
pieces (for non-causal models). Every function here is pure: no collectives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .mesh import TSPMesh

IGNORE_INDEX = -100


def num_chunks(size: int, layout: str) -> int:
    """How many equal chunks the sequence is cut into."""
    if layout == "zigzag":
        return 2 * size
    if layout == "contiguous":
        return size
    raise ValueError(f"unknown layout {layout!r}; use 'zigzag' or 'contiguous'")


def rank_chunks(rank: int, size: int, layout: str) -> tuple[int, ...]:
    """Global chunk indices owned by ``rank``, in local order."""
    if layout == "zigzag":
        return (rank, 2 * size - 1 - rank)
    num_chunks(size, layout)
    return (rank,)


def check_seq_len(seq_len: int, size: int, layout: str) -> int:
    """Return the chunk length after checking that ``seq_len`` splits evenly."""
    n = num_chunks(size, layout)
    if seq_len % n:
        raise ValueError(f"sequence length ({seq_len}) must be a multiple of {n} "
                         f"({'2*' if layout == 'zigzag' else ''}tsp_size, tsp_size={size}, "
                         f"layout={layout}); pad it with tsp_core.shard_batch or pad_to_multiple")
    return seq_len // n


def local_segments(seq_len: int, rank: int, size: int, layout: str = "zigzag") -> list[tuple[int, int]]:
    """Global ``[start, end)`` ranges of the local tokens, in local order."""
    c = check_seq_len(seq_len, size, layout)
    return [(k * c, (k + 1) * c) for k in rank_chunks(rank, size, layout)]


def shard_sequence(x: torch.Tensor, rank: int, size: int, dim: int = 1,
                   layout: str = "zigzag") -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (a copy, so the full tensor can be freed)."""
    segs = local_segments(x.shape[dim], rank, size, layout)
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


def to_rank_order(full: torch.Tensor, size: int, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
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


_BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def shard_batch(batch: dict[str, Any], mesh: "TSPMesh", *,
                ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """This rank's part of a full-sequence batch (identical on every rank of the TSP group).

    Returns ``input_ids``, ``position_ids`` (global), ``shift_labels`` (when ``labels`` is given:
    shifted on the full sequence before sharding, so no rank needs its neighbour's first token) and
    ``attention_mask`` (when given). The sequence is padded at the end to a multiple of 2*D (zigzag)
    or D (contiguous); padded positions are ignored by the loss and masked out.
    """
    unknown = sorted(set(batch) - set(_BATCH_KEYS))
    if unknown:
        raise ValueError(f"shard_batch does not know how to shard {unknown}; it takes "
                         f"{list(_BATCH_KEYS)} (full-sequence tensors of shape [batch, seq])")
    if "input_ids" not in batch:
        raise ValueError("shard_batch needs 'input_ids' of shape [batch, seq]")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [batch, seq], got {tuple(ids.shape)}")
    size, rank, layout = mesh.size, mesh.rank, mesh.layout
    seq = ids.shape[1]
    if seq < 2 * size:
        raise ValueError(f"sequence length ({seq}) is shorter than 2*tsp_size ({2 * size}): every "
                         f"rank needs tokens of its own; use a smaller tsp_size or longer sequences")
    for key in ("labels", "attention_mask", "position_ids"):
        if key in batch and tuple(batch[key].shape) != tuple(ids.shape):
            raise ValueError(f"{key} has shape {tuple(batch[key].shape)} but input_ids has "
                             f"{tuple(ids.shape)}; pass full-sequence tensors of the same shape")

    if "attention_mask" in batch:
        mask = batch["attention_mask"]
        holes = (mask[:, 1:] > mask[:, :-1]).any(dim=1).nonzero().flatten().tolist()
        if holes:
            raise ValueError(f"attention_mask rows {holes} have a 0 before a 1 (left padding or "
                             f"holes); TSP's causal attention supports right padding only: pad on "
                             f"the right (tokenizer.padding_side = 'right')")

    def local(x: torch.Tensor, pad: int) -> torch.Tensor:
        return shard_sequence(pad_to_multiple(x, size, pad, 1, layout), rank, size, 1, layout)

    out = {"input_ids": local(ids, 0)}
    if "position_ids" in batch:
        pos = batch["position_ids"]
        padded = padded_length(seq, size, layout)
        tail = pos[:, -1:] + torch.arange(1, padded - seq + 1, device=pos.device)
        out["position_ids"] = shard_sequence(torch.cat([pos, tail], 1), rank, size, 1, layout)
    else:
        pos = position_ids(padded_length(seq, size, layout), rank, size, layout, ids.device)
        out["position_ids"] = pos.unsqueeze(0).expand(ids.shape[0], -1).contiguous()
    if "labels" in batch:
        out["shift_labels"] = local(shift_labels(batch["labels"], ignore_index), ignore_index)
    if "attention_mask" in batch:
        out["attention_mask"] = local(batch["attention_mask"], 0)
    return out

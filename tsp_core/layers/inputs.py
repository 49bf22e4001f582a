"""What every TSP layer checks in its input before any collective: this rank's tokens
[batch, local_seq, hidden_size] and, for packed rows, document lengths that describe the whole
sequence. The same input on every rank raises the same error on every rank, so none hangs."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_local_input(x: torch.Tensor, hidden_size: int) -> None:
    """A layer's input must be this rank's tokens [batch, local_seq, hidden_size]."""
    if x.dim() != 3 or x.shape[-1] != hidden_size:
        raise ValueError(f"input of shape {tuple(x.shape)} does not match the layer: expected "
                         f"[batch, local_seq, hidden_size={hidden_size}]")


def checked_docs(docs: Sequence[Sequence[int]] | None, x: torch.Tensor, tsp_size: int
                 ) -> tuple[tuple[int, ...], ...] | None:
    """Packed rows' document lengths (``shard_batch``'s ``tsp_docs``) as tuples: one row per
    batch row, each summing to the whole sequence (``local_seq * tsp_size`` tokens)."""
    if docs is None:
        return None
    docs = tuple(tuple(int(n) for n in row) for row in docs)
    if len(docs) != x.shape[0] or any(sum(row) != x.shape[1] * tsp_size for row in docs):
        raise ValueError(f"docs {docs} do not describe {x.shape[0]} rows of "
                         f"{x.shape[1] * tsp_size} tokens; pass shard_batch's tsp_docs")
    return docs

"""The chunk arithmetic of the token layouts: how many equal chunks a sequence is cut into, which
chunks a rank owns, and the global token ranges that gives, per row or per packed document.

It lives with the collectives because they need it (a K/V all-gather restores sequence order from
it); :mod:`tsp_core.sequence.layout` builds the user-facing sharding on top. Pure: no collectives.
"""

from __future__ import annotations

from collections.abc import Sequence


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


def row_segments(docs: Sequence[int], rank: int, size: int,
                 layout: str = "zigzag") -> list[tuple[int, int, int]]:
    """``(start, end, doc_start)`` of this rank's tokens of one row, in local order. The row is a
    sequence of documents (one for an unpacked row), each a multiple of ``num_chunks`` long; each
    document is cut into chunks and dealt out like a whole sequence, so causal work stays balanced
    whatever the mix of document lengths."""
    segs, start = [], 0
    for n in docs:
        c = check_seq_len(n, size, layout)
        segs += [(start + k * c, start + (k + 1) * c, start)
                 for k in rank_chunks(rank, size, layout)]
        start += n
    return segs


def local_segments(seq_len: int, rank: int, size: int, layout: str = "zigzag",
                   docs: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Global ``[start, end)`` ranges of the local tokens, in local order."""
    return [(a, b) for a, b, _ in row_segments(docs or (seq_len,), rank, size, layout)]

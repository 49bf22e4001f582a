"""The TSP sizes a model's shapes allow: one rule, named by every "tsp_size must divide" error so
that it says which sizes would work instead of only which does not."""

from __future__ import annotations

from collections.abc import Sequence


def valid_tsp_sizes(num_heads: int | None = None, num_kv_heads: int | None = None,
                    *divided: int) -> list[int]:
    """Every TSP size D that can split these shapes, ascending: D divides ``num_heads`` and each
    of ``divided`` (intermediate sizes, the number of experts: what is cut into D equal
    slices), and D and ``num_kv_heads`` divide one another (each rank's query heads share
    whole key/value heads, or each key/value head is split over whole ranks). D goes up to
    ``num_heads``, or without heads the smallest of ``divided``."""
    sizes = [n for n in (num_heads, *divided) if n is not None]
    if not sizes or min(sizes) < 1:
        return []
    return [d for d in range(1, min(sizes) + 1)
            if all(n % d == 0 for n in sizes)
            and (not num_kv_heads or num_kv_heads % d == 0 or d % num_kv_heads == 0)]


def valid_sizes_hint(sizes: Sequence[int], what: str = "this model") -> str:
    """``valid tsp_size values for <what>: 1, 2, 4``, the end of every such error."""
    return f"valid tsp_size values for {what}: {', '.join(str(d) for d in sizes) or 'none'}"

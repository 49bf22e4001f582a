"""Token tiles (docs/design.md "Long context"): the MLP, the experts and the loss process a
rank's tokens a tile at a time, so their working set is bounded by the tile, not by the
sequence. A tile size of None is chosen from the layer's sizes so that one tile's working set
stays under :data:`TILE_BYTES`."""

from __future__ import annotations

# the working set one tile may use (bytes): what tile_tokens=None aims for
TILE_BYTES = 256 * 1024 ** 2


def check_tile_tokens(tile_tokens: int | None) -> None:
    """``tile_tokens`` is None (chosen from the sizes) or a positive number of tokens."""
    if tile_tokens is None:
        return
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens <= 0:
        raise ValueError(f"tile_tokens ({tile_tokens!r}) must be a positive number of tokens, or "
                         f"None to choose it from the model's sizes (a tile's working set under "
                         f"{TILE_BYTES // 1024 ** 2} MiB)")


def token_tiles(n: int, tile: int) -> list[slice]:
    """The slices of ``n`` tokens, ``tile`` at a time (the last one shorter)."""
    return [slice(start, min(start + tile, n)) for start in range(0, n, max(1, tile))]

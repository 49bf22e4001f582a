"""Token tiles (docs/design.md "Long context"): the MLP, the experts and the loss process a
rank's tokens a tile at a time, so their working set is bounded by the tile, not by the
sequence. A tile size of None is chosen from the layer's sizes so that one tile's working set
stays under :data:`TILE_BYTES`.

The bounds, per tile of T tokens, with F/D a rank's intermediate channels (of one expert for a
mixture of experts) and V/D its vocabulary rows:

- gated MLP, experts: at most :data:`MLP_TILE_TENSORS` tensors [T, F/D] in the compute dtype at
  once, forward or backward (the backward's recomputed gate, up and activation, dM, dUp and
  the activation's derivative);
- loss (cross-entropy and token statistics): at most :data:`LOSS_TILE_TENSORS` tensors
  [T, V/D] in float32 (float64 for a float64 model) at once, forward or backward.

:func:`mlp_tile_tokens` and :func:`loss_tile_tokens` choose the largest T whose bound fits
:data:`TILE_BYTES`; ``tests/layers/test_tiles.py`` measures the working sets under fake tensors.
"""

from __future__ import annotations

import torch

# the working set one tile may use (bytes): what tile_tokens=None aims for
TILE_BYTES = 256 * 1024 ** 2
# [T, F/D] tensors (compute dtype) one MLP or expert tile holds at once, at most
MLP_TILE_TENSORS = 6
# [T, V/D] tensors (float32, float64 for a float64 model) one loss tile holds at once, at most
LOSS_TILE_TENSORS = 3
# [T, h] float32 tensors one RMSNorm tile holds at once in its backward, at most
NORM_TILE_TENSORS = 8
# a chosen tile of at least this many tokens is rounded down to a multiple of it (matmul shapes)
TILE_ALIGN = 128


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


def _fitting(row_bytes: int, tensors: int) -> int:
    """The most tokens whose ``tensors`` rows of ``row_bytes`` each fit :data:`TILE_BYTES`,
    rounded down to a multiple of :data:`TILE_ALIGN` when that many fit (at least 1)."""
    tokens = max(1, TILE_BYTES // max(1, tensors * row_bytes))
    return tokens - tokens % TILE_ALIGN if tokens >= TILE_ALIGN else tokens


def mlp_tile_tokens(local_channels: int, dtype: torch.dtype) -> int:
    """The tile of a gated MLP (or an expert) whose rank holds ``local_channels`` (F/D)
    intermediate channels: :data:`MLP_TILE_TENSORS` x tile x F/D elements of ``dtype`` stay
    under :data:`TILE_BYTES`. Llama-3.1-8B at D = 8 in bf16: F/D = 1792, 12416 tokens."""
    return _fitting(local_channels * dtype.itemsize, MLP_TILE_TENSORS)


def loss_tile_tokens(local_vocab: int, dtype: torch.dtype) -> int:
    """The tile of the vocabulary-parallel loss whose rank holds ``local_vocab`` (V/D) rows, for
    hidden states of ``dtype``: :data:`LOSS_TILE_TENSORS` x tile x V/D logits in float32 (float64
    for a float64 model) stay under :data:`TILE_BYTES`. Llama-3.1-8B at D = 8: V/D = 16032, 1280
    tokens."""
    acc = 8 if dtype == torch.float64 else 4
    return _fitting(local_vocab * acc, LOSS_TILE_TENSORS)


def norm_tile_tokens(hidden_size: int) -> int:
    """The tile of an RMSNorm over ``hidden_size`` channels: :data:`NORM_TILE_TENSORS` x tile x
    h float32 elements stay under :data:`TILE_BYTES`. h = 4096: 2048 tokens."""
    return _fitting(hidden_size * 4, NORM_TILE_TENSORS)


def grad_accumulator(numel: int, dtype: torch.dtype, device: torch.device,
                     tiles: int) -> torch.Tensor:
    """Zeros for one weight shard's gradient summed over ``tiles`` token tiles: float32 for a
    16-bit model when there is more than one tile (the tiles' products are summed wide, as one
    matmul over all the tokens would), else ``dtype``."""
    wide = tiles > 1 and dtype in (torch.bfloat16, torch.float16)
    return torch.zeros(numel, dtype=torch.float32 if wide else dtype, device=device)


class TokenTiled:
    """Mixin of the modules that take ``tile_tokens`` (``parallelize`` sets it on every module
    that has the attribute): None chooses it from the sizes; a number <= 0 is refused."""

    _tile_tokens: int | None = None

    @property
    def tile_tokens(self) -> int | None:
        return self._tile_tokens

    @tile_tokens.setter
    def tile_tokens(self, value: int | None) -> None:
        check_tile_tokens(value)
        self._tile_tokens = value

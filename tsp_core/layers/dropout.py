"""Dropout on this rank's own tokens (:class:`RankDropout`), with masks that differ between ranks
and replay exactly under activation checkpointing.

Each call draws one 62-bit number from the global torch RNG (CPU), mixes it with the global
rank, seeds a generator of this rank's own with it and draws the mask from that generator. So a
run is reproducible from the user's ``torch.manual_seed`` (every rank draws the same number, as
every rank of a data-parallel job seeds alike), the ranks of the mesh (TSP and data-parallel)
draw independent masks, and a checkpointed layer's recompute replays the same mask:
``torch.utils.checkpoint`` restores the global RNG state before recomputing (its default
``preserve_rng_state=True``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct ranks give distinct seeds


def rank_seed(draw: int, rank: int) -> int:
    """The seed of ``rank``'s mask generator for one global draw: ``draw`` XOR ``rank`` times an
    odd constant, in 63 bits (distinct for distinct ranks below 2**63)."""
    return (draw ^ (rank * _MIX)) & (2 ** 63 - 1)


class RankDropout:
    """A forward hook (``module.register_forward_hook``) that applies dropout with probability
    ``p`` to the module's output (its first element when it returns a tuple) in training mode:
    elements zeroed with probability ``p``, the rest scaled by 1/(1-p), the mask drawn as the
    module docstring says. A hook rather than a layer so that the module keeps its parameter
    names; in eval mode and at p = 0 it returns the output untouched (exactly today's path)."""

    def __init__(self, p: float, rank: int | None = None):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} must be in [0, 1)")
        self.p = p
        self.rank = (dist.get_rank() if dist.is_initialized() else 0) if rank is None else rank
        self._generators: dict[torch.device, torch.Generator] = {}

    def mask(self, like: torch.Tensor) -> torch.Tensor:
        """The keep mask for ``like``: True where an element is kept."""
        draw = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64).item())
        gen = self._generators.get(like.device)
        if gen is None:
            gen = self._generators[like.device] = torch.Generator(device=like.device)
        gen.manual_seed(rank_seed(draw, self.rank))
        noise = torch.rand(like.shape, generator=gen, device=like.device, dtype=torch.float32)
        return noise >= self.p

    def __call__(self, module: nn.Module, inputs, output):
        if not module.training or self.p == 0.0:
            return output
        first = output[0] if isinstance(output, tuple) else output
        dropped = first * self.mask(first).to(first.dtype) / (1.0 - self.p)
        return (dropped, *output[1:]) if isinstance(output, tuple) else dropped

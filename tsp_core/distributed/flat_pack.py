"""One flat buffer for a round's weight shards, so each round moves them in a single collective."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class FlatPack:
    """Packs tensors of fixed shapes into one flat buffer and views them back out."""

    def __init__(self, shapes: Sequence[torch.Size]) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.sizes)

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [p.view(s) for p, s in zip(flat.split(self.sizes), self.shapes)]

"""Dropout on this rank's own tokens (:class:`RankDropout`) and of the attention probabilities of
this rank's queries (:class:`AttentionDropout`), with masks that differ between ranks and replay
exactly under activation checkpointing.

Each call draws one 62-bit number from the global torch RNG (CPU), mixes it with the global
rank, seeds a generator of this rank's own with it and draws the mask from that generator. So a
run is reproducible from the user's ``torch.manual_seed`` (every rank draws the same number, as
every rank of a data-parallel job seeds alike), the ranks of the mesh (TSP and data-parallel)
draw independent masks, and a checkpointed layer's recompute replays the same mask:
``torch.utils.checkpoint`` restores the global RNG state before recomputing (its default
``preserve_rng_state=True``).

The attention's mask is not drawn from a generator's stream but hashed from its coordinates
(:meth:`AttentionDropout.keep`): the attention's forward and backward visit the (query, key)
pairs in different blocks (flash.key_blocks), and a hashed mask is the same whichever block
asks for it, without storing a mask as large as the scores (docs/design.md "Memory rules")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct ranks give distinct seeds


def rank_seed(draw: int, rank: int) -> int:
    """The seed of ``rank``'s mask generator for one global draw: ``draw`` XOR ``rank`` times an
    odd constant, in 63 bits (distinct for distinct ranks below 2**63)."""
    return (draw ^ (rank * _MIX)) & (2 ** 63 - 1)


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def drawn_seed(rank: int) -> int:
    """One draw from the global torch RNG (the same on every rank seeded alike), made ``rank``'s
    own by :func:`rank_seed`."""
    return rank_seed(int(torch.randint(0, 2 ** 62, (), dtype=torch.int64).item()), rank)


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
        self.rank = global_rank() if rank is None else rank
        self._generators: dict[torch.device, torch.Generator] = {}

    def mask(self, like: torch.Tensor, p: float | None = None) -> torch.Tensor:
        """The keep mask for ``like``: True where an element is kept (with probability 1 - p;
        ``p`` defaults to this hook's)."""
        gen = self._generators.get(like.device)
        if gen is None:
            gen = self._generators[like.device] = torch.Generator(device=like.device)
        gen.manual_seed(drawn_seed(self.rank))
        noise = torch.rand(like.shape, generator=gen, device=like.device, dtype=torch.float32)
        return noise >= (self.p if p is None else p)

    def drop(self, x: torch.Tensor, p: float) -> torch.Tensor:
        """``x`` with elements zeroed with probability ``p`` and the rest scaled by 1/(1-p)."""
        return x * self.mask(x, p).to(x.dtype) / (1.0 - p)

    def __call__(self, module: nn.Module, inputs, output):
        if not module.training or self.p == 0.0:
            return output
        first = output[0] if isinstance(output, tuple) else output
        dropped = self.drop(first, self.p)
        return (dropped, *output[1:]) if isinstance(output, tuple) else dropped


class RankDropoutModule(nn.Dropout):
    """An ``nn.Dropout`` that drops each rank's own tokens with masks of the rank's own (as
    :class:`RankDropout`), in place of a decoder layer's own dropout module (Phi-3's
    ``resid_attn_dropout``), which would draw the same mask positions on every rank. Still an
    ``nn.Dropout`` whose ``p`` is read at each call, so what turns a model's dropout modules off
    acts on it as on the module it replaced (TRL's ``disable_dropout_in_model`` sets ``p = 0``,
    the default of its DPO trainer); ``inplace`` is not supported."""

    def __init__(self, p: float, rank: int | None = None):
        super().__init__(p)
        self.masks = RankDropout(p, rank)

    @classmethod
    def replacing(cls, module: nn.Dropout) -> RankDropoutModule:
        if module.inplace:
            raise ValueError(f"{module!r}: an in-place dropout module cannot take each rank's "
                             f"own masks; build the model with inplace=False")
        return cls(module.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return self.masks.drop(x, self.p)


# splitmix64's finaliser, on int64 tensors (their products wrap modulo 2**64): a bijection that
# spreads every input bit over the output, so consecutive coordinates give unrelated numbers
_M1, _M2 = 0xBF58476D1CE4E5B9 - 2 ** 64, 0x94D049BB133111EB - 2 ** 64
_C_BATCH, _C_HEAD, _C_ROW, _C_KEY = (0xD6E8FEB86659FD93 - 2 ** 64, 0xA0761D6478BD642F - 2 ** 64,
                                     0xE7037ED1A0B428DB - 2 ** 64, 0x8EBC6AF09C88C6E3 - 2 ** 64)
_BITS = 24  # a uniform draw in [0, 1) per element, to 2**-24


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout of the attention probabilities with probability ``p`` (Hugging Face's eager order:
    softmax, dropout, times V), the keep mask a hash of ``seed`` and each element's coordinates:
    (batch row, query head, local query row, key). :meth:`drawn` gives this rank's seed for one
    forward; :meth:`at` derives one per round and row group, so no two calls share a mask."""

    p: float
    seed: int

    def __post_init__(self) -> None:
        if not 0.0 < self.p < 1.0:
            raise ValueError(f"attention dropout probability {self.p} must be in (0, 1); at 0 "
                             f"pass no AttentionDropout (exactly the path without dropout)")

    @classmethod
    def drawn(cls, p: float, rank: int | None = None) -> AttentionDropout:
        """This rank's dropout for one forward: a draw from the global RNG (:func:`drawn_seed`),
        which activation checkpointing's recompute replays."""
        return cls(p, drawn_seed(global_rank() if rank is None else rank))

    def at(self, *where: int) -> AttentionDropout:
        """The dropout of one call (say a round and a row group): the seed mixed with ``where``."""
        x = torch.tensor(self.seed, dtype=torch.int64)
        for w in where:  # products of int64 tensors wrap; of Python ints they would not
            x = _mix(x + torch.tensor(w + 1, dtype=torch.int64) * _C_BATCH)
        return AttentionDropout(self.p, int(x.item()) & (2 ** 63 - 1))

    def keep(self, batch: int, heads: int, rows: tuple[int, int], keys: tuple[int, int],
             device: torch.device | str) -> torch.Tensor:
        """The keep mask [batch, heads, rows, keys] (True: kept) of local query rows
        ``[rows[0], rows[1])`` against keys ``[keys[0], keys[1])``: each element kept with
        probability 1 - p, independently of every other (as far as a 64-bit hash is)."""
        i64 = dict(dtype=torch.int64, device=device)
        b = torch.arange(batch, **i64)[:, None] * _C_BATCH
        h = torch.arange(heads, **i64)[None, :] * _C_HEAD
        per_head = _mix(self.seed + b + h)[..., None]                          # [B, H, 1]
        per_row = _mix(per_head + torch.arange(*rows, **i64) * _C_ROW)[..., None]
        u = _shr(_mix(per_row + torch.arange(*keys, **i64) * _C_KEY), 64 - _BITS)
        return u >= round(self.p * 2 ** _BITS)

    def apply(self, probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``probs`` with the dropped elements zeroed and the rest scaled by 1/(1-p)."""
        return probs * keep.to(probs.dtype) / (1.0 - self.p)

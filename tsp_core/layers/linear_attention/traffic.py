"""Collectives of one TSP Gated DeltaNet layer (docs/design.md "Gated DeltaNet"), by kind: calls
and per-rank bytes by :mod:`tsp_core.distributed.comm`'s rule ((D-1)/D of the buffer for a
broadcast, reduce, all-gather or reduce-scatter, 2(D-1)/D for an all-reduce). The layer's test
holds the counted collectives to these numbers exactly.

Per layer, with W = one rank's weight shard (elements), T = the tails of every chunk of the
group (D x 2 chunks x min(chunk, kernel - 1) tokens x h per row), M = every chunk's map
(D x 2 chunks x nv/D heads x d_k (d_k + d_v) per row, in the compute dtype, float32 at least):

- forward: D broadcasts of W, 1 all-gather of T, D all-gathers of M;
- backward: the same again (nothing gathered is kept), D reduce-scatters of M (the map
  gradients to their owners), D reduces of W (weight gradients to their owners), 1
  reduce-scatter of T (the halo gradients) and the norm weight's all-reduce (d_v).
"""

from __future__ import annotations

import math

import torch

from .delta_rule import compute_dtype
from .schedule import ChunkLayout, DeltaNetSpec, chunk_units


def delta_net_collectives(spec: DeltaNetSpec, batch: int, local_len: int,
                          dtype: torch.dtype, docs=None) -> dict[str, dict[str, tuple[int, float]]]:
    """``{"forward": {kind: (calls, bytes)}, "backward": {...}}`` of one layer on one rank for
    ``batch`` rows of ``local_len`` local tokens (``docs``: packed rows, as the layer takes
    them). A group of one rank issues nothing."""
    D = spec.tsp_size
    if D == 1:
        return {"forward": {}, "backward": {}}
    units, _ = chunk_units(docs, batch, local_len, spec)
    lay = ChunkLayout(units, spec, 0)
    x_bytes = torch.empty(0, dtype=dtype).element_size()
    c_bytes = torch.empty(0, dtype=compute_dtype(dtype)).element_size()
    part = (D - 1) / D
    weights = sum(math.prod(s) for s in spec.round_shapes()) * x_bytes * part
    tails = D * sum(len(u.rows) * t for u, t in zip(units, lay.tail)) * spec.hidden_size
    tails_bytes = tails * x_bytes * part
    maps = D * sum(math.prod(s) for s in lay.map_shape) * c_bytes * part
    halo = spec.halo > 0  # a kernel of 1 has no halo: no tails move
    forward = {"broadcast": (D, D * weights),
               "all_gather": (D + halo, D * maps + halo * tails_bytes)}
    backward = {"broadcast": (D, D * weights),
                "all_gather": (D + halo, D * maps + halo * tails_bytes),
                "reduce_scatter": (D + halo, D * maps + halo * tails_bytes),
                "reduce": (D, D * weights),
                "all_reduce": (1, 2 * spec.head_v_dim * x_bytes * part)}
    return {"forward": forward, "backward": backward}

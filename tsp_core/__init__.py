"""Folded tensor-and-sequence parallelism (TSP) for PyTorch: every rank of a TSP group holds 1/D
of each weight matrix and 1/D of the tokens."""

from . import comm, layout
from .attention import TSPAttention
from .layout import position_ids, shard_batch, shard_sequence, unshard_sequence
from .mesh import TSPMesh, init_mesh
from .mlp import TSPGatedMLP

__all__ = ["TSPAttention", "TSPGatedMLP", "TSPMesh", "comm", "init_mesh", "layout",
           "position_ids", "shard_batch", "shard_sequence", "unshard_sequence"]

"""Tokens: which rank owns which (zigzag or contiguous layouts), ``shard_batch`` with its packed
rows (documents per row), batch fingerprints and labels shifted before sharding.

Imports only :mod:`tsp_core.distributed` (docs/design.md "Code map")."""

from . import gather, layout
from .gather import gather_tokens
from .layout import IGNORE_INDEX, position_ids, shard_batch, shard_sequence, unshard_sequence

__all__ = ["IGNORE_INDEX", "gather", "gather_tokens", "layout", "position_ids", "shard_batch",
           "shard_sequence", "unshard_sequence"]

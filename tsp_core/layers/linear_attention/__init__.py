"""Linear attention under TSP: Qwen3.5's Gated DeltaNet layers (docs/design.md "Gated DeltaNet")."""

from .module import TSPGatedDeltaNet, check_delta_net_shape
from .schedule import DeltaNetSpec, GatedDeltaNetFn

__all__ = ["DeltaNetSpec", "GatedDeltaNetFn", "TSPGatedDeltaNet", "check_delta_net_shape"]

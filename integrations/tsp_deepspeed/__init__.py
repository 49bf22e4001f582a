"""DeepSpeed adapter: ``tsp_deepspeed.initialize(..., tsp_size=D)`` is ``deepspeed.initialize``
with TSP, ZeRO partitioning over the data-parallel axis only."""

from .engine import TSPMPU, initialize, routed

__all__ = ["TSPMPU", "initialize", "routed"]

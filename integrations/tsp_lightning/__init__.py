"""Lightning adapter: ``Trainer(strategy="tsp")``, ``Trainer(strategy="tsp_deepspeed")`` and
``Fabric(strategy="tsp")`` after ``import tsp_lightning`` (Lightning has no entry point for
strategies, so importing registers)."""

from .deepspeed import TSPDeepSpeedStrategy
from .fabric import TSPFabricStrategy
from .monitor import TSPMonitor
from .strategy import SUPPORTED_PRECISIONS, TSPStrategy


def register() -> None:
    """Register "tsp" with the Trainer's and Fabric's strategy registries, and "tsp_deepspeed"
    with the Trainer's (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    StrategyRegistry.register("tsp", TSPStrategy, override=True,
                              description="Folded tensor-and-sequence parallelism (tsp_core)")
    StrategyRegistry.register("tsp_deepspeed", TSPDeepSpeedStrategy, override=True,
                              description="TSP with DeepSpeed ZeRO (stage 2) over data parallel")
    STRATEGY_REGISTRY.register("tsp", TSPFabricStrategy, override=True,
                               description="Folded tensor-and-sequence parallelism (tsp_core)")


register()

__all__ = ["SUPPORTED_PRECISIONS", "TSPDeepSpeedStrategy", "TSPFabricStrategy", "TSPMonitor",
           "TSPStrategy", "register"]

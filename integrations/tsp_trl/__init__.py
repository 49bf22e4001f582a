"""TRL adapter: ``TSPSFTTrainer`` / ``TSPSFTConfig`` and ``TSPDPOTrainer`` / ``TSPDPOConfig``,
TRL's SFTTrainer and DPOTrainer with TSP switched on by one argument (``tsp_size``), as
``tsp_transformers.TSPTrainer`` is for the Trainer (docs/trl.md)."""

from .dpo import TSPDPOConfig, TSPDPOTrainer
from .sft import TSPSFTConfig, TSPSFTTrainer

__all__ = ["TSPDPOConfig", "TSPDPOTrainer", "TSPSFTConfig", "TSPSFTTrainer"]

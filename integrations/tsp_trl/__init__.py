"""TRL adapter: ``TSPSFTTrainer`` / ``TSPSFTConfig``, ``TSPDPOTrainer`` / ``TSPDPOConfig`` and
``TSPGRPOTrainer`` / ``TSPGRPOConfig``, TRL's SFTTrainer, DPOTrainer and GRPOTrainer with TSP
switched on by one argument (``tsp_size``), as ``tsp_transformers.TSPTrainer`` is for the Trainer
(docs/trl.md)."""

from .dpo import TSPDPOConfig, TSPDPOTrainer
from .grpo import TSPGRPOConfig, TSPGRPOTrainer
from .sft import TSPSFTConfig, TSPSFTTrainer

__all__ = ["TSPDPOConfig", "TSPDPOTrainer", "TSPGRPOConfig", "TSPGRPOTrainer", "TSPSFTConfig",
           "TSPSFTTrainer"]

"""TRL adapter: ``TSPSFTTrainer`` / ``TSPSFTConfig``, TRL's SFTTrainer with TSP switched on by
one argument (``tsp_size``), as ``tsp_transformers.TSPTrainer`` is for the Trainer
(docs/trl.md)."""

from .sft import TSPSFTConfig, TSPSFTTrainer

__all__ = ["TSPSFTConfig", "TSPSFTTrainer"]

"""Transformers adapter: shard-on-read loading, ``TSPTrainingArguments(tsp_size=D)`` and
``TSPTrainer``."""

from .loading import load_pretrained
from .trainer import TSPTrainer, TSPTrainingArguments

__all__ = ["TSPTrainer", "TSPTrainingArguments", "load_pretrained"]

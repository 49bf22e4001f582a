"""Serving a TSP model: prefill and decode over the sequence-sharded KV cache, generation (greedy
or sampled, Hugging Face's ``generate``), and full logits for evaluation.

Imports only the layers below it (docs/design.md "Code map"); the TSP model class offers
``generate`` from here, as Hugging Face's models build on their generation mixin."""

from . import decode, generation, logits
from .generation import generate
from .logits import FullLogits, full_logits

__all__ = ["FullLogits", "decode", "full_logits", "generate", "generation", "logits"]

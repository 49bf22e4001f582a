"""What a TSP model's forward returns for ``fused_lm_head=True``.

TRL's trainers ask a model for per-token statistics of the next-token distribution instead of
logits (``trl.trainer.utils.add_fused_lm_head`` and its ``FusedCausalLMOutput``). A TSP model
answers from its vocabulary-parallel head (docs/trl.md). :class:`FusedLMOutput` has the same
fields in the same order, so TRL reads it as its own head's output by name or by position,
without tsp_core depending on TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput


@dataclass
class FusedLMOutput(ModelOutput):
    """Per-token fields are zero where the label is -100; ``loss`` is the global mean (see
    ``tsp_core.models.runtime.fused_output``)."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None

"""A policy's ``head`` group: :class:`HeadPolicy`, what a family does to its logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HeadPolicy:
    """What a family does to the LM head's logits beyond the product (defaults: Llama's, nothing),
    each a function of the config, as :class:`~tsp_core.layers.vocab.TSPLMHead` takes it by the
    same name: the loss, ``logits``, ``full_logits`` and generation all see the same logits.
    ``logits_divisor``: the logits are divided by it (Granite's ``logits_scaling``);
    ``logits_softcap``: after the divisor, ``tanh(x / cap) * cap`` (Gemma 2's
    ``final_logit_softcapping``), None: off."""

    logits_divisor: Callable[[Any], float] | None = None
    logits_softcap: Callable[[Any], float | None] | None = None

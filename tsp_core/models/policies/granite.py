"""Granite (GraniteForCausalLM): Llama's layout with four multipliers: ``embedding_multiplier``
and ``residual_multiplier`` (the model's and the layer's own forward apply them),
``attention_multiplier`` (the softmax scale: the module's ``scaling``) and ``logits_scaling``
(the logits are divided by it: ``logits_divisor``)."""

from .base import DecoderPolicy, register_policy
from .head import HeadPolicy

POLICY = register_policy(DecoderPolicy(
    name="granite", model_types=("granite",), class_names=("GraniteForCausalLM",),
    head=HeadPolicy(logits_divisor=lambda config: config.logits_scaling)))

"""Mistral (MistralForCausalLM): Llama's layout; every layer uses ``config.sliding_window``
(None disables it)."""

from .base import DecoderPolicy, register_policy


def _window(config, attention):
    return getattr(config, "sliding_window", None)


POLICY = register_policy(DecoderPolicy(name="mistral", model_types=("mistral",),
                                       class_names=("MistralForCausalLM",),
                                       sliding_window=_window))

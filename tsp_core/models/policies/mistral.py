"""Mistral (MistralForCausalLM): Llama's layout; every layer uses ``config.sliding_window``
(None disables it)."""

from .attention import AttentionPolicy, window_from_config
from .base import DecoderPolicy, register_policy

POLICY = register_policy(DecoderPolicy(name="mistral", model_types=("mistral",),
                                       class_names=("MistralForCausalLM",),
                                       attn=AttentionPolicy(sliding_window=window_from_config)))

"""Llama (LlamaForCausalLM): the reference layout; biases follow ``attention_bias`` and
``mlp_bias``, which the converter reads from the modules themselves."""

from .base import DecoderPolicy, register_policy

POLICY = register_policy(DecoderPolicy(name="llama", model_types=("llama",),
                                       class_names=("LlamaForCausalLM",)))

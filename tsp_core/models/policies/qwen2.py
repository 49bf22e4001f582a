"""Qwen2 (Qwen2ForCausalLM): Llama's layout with q/k/v biases; a layer's sliding window is the
attention module's own ``sliding_window`` (set from ``config.layer_types``)."""

from .attention import AttentionPolicy, window_from_module
from .base import DecoderPolicy, register_policy

POLICY = register_policy(DecoderPolicy(name="qwen2", model_types=("qwen2",),
                                       class_names=("Qwen2ForCausalLM",),
                                       attn=AttentionPolicy(sliding_window=window_from_module)))

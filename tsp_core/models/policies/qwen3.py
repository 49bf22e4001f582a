"""Qwen3 (Qwen3ForCausalLM): Qwen2's layout without q/k/v biases (``attention_bias`` sets all four)
and with an RMSNorm over head_dim on every query and key head before RoPE (``q_norm``,
``k_norm``); explicit ``head_dim``; sliding layers from ``config.layer_types``."""

from .attention import PER_HEAD, AttentionPolicy, window_from_module
from .base import DecoderPolicy, register_policy

POLICY = register_policy(DecoderPolicy(name="qwen3", model_types=("qwen3",),
                                       class_names=("Qwen3ForCausalLM",),
                                       attn=AttentionPolicy(sliding_window=window_from_module,
                                                            qk_norm=PER_HEAD)))

"""EXAONE 4 (Exaone4ForCausalLM): Llama's projections with per-head q/k RMSNorms before RoPE
(``q_norm``, ``k_norm``, as Qwen3) and OLMo 2's placement of the layer norms, after attention and
after the MLP (the layer's own forward applies them), in Llama's numerics. Its hybrid layout
(``sliding_window`` set): sliding layers from ``layer_types`` with RoPE, and full layers that
apply no rotary at all ("global NoPE": ``rotary``); with ``sliding_window=None`` every layer is
global and rotates."""

from .base import DecoderPolicy, register_policy


def _window(config, attention):
    return attention.sliding_window if attention.is_sliding else None


def _rotary(config, attention):
    return attention.sliding_window is None or attention.is_sliding


POLICY = register_policy(DecoderPolicy(
    name="exaone4", model_types=("exaone4",), class_names=("Exaone4ForCausalLM",),
    layer_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    head_norms=("q_norm", "k_norm"), sliding_window=_window, rotary=_rotary))

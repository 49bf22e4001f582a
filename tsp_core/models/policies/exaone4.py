"""EXAONE 4 (Exaone4ForCausalLM): Llama's projections with per-head q/k RMSNorms before RoPE
(``q_norm``, ``k_norm``, as Qwen3) and OLMo 2's placement of the layer norms, after attention and
after the MLP (the layer's own forward applies them), in Llama's numerics.

Its hybrid layout (``sliding_window`` set: sliding layers from ``layer_types``, and the full layers
apply no rotary at all, "global NoPE") is refused by ``config.sliding_window``: TSP attention
rotates every layer's q and k, so a NoPE layer would silently get RoPE. The all-global models
(``sliding_window=None``, EXAONE 4.0 1.2B's layout) run exactly."""

from .base import DecoderPolicy, register_policy


def _window(config, attention):
    return attention.sliding_window if getattr(attention, "is_sliding", False) else None


POLICY = register_policy(DecoderPolicy(
    name="exaone4", model_types=("exaone4",), class_names=("Exaone4ForCausalLM",),
    layer_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    head_norms=("q_norm", "k_norm"), sliding_window=_window,
    unsupported=(("sliding_window", "hybrid attention: its full layers apply no rotary (NoPE)"),)))

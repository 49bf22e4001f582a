"""EXAONE 4 (Exaone4ForCausalLM): Llama's projections with per-head q/k RMSNorms before RoPE
(``q_norm``, ``k_norm``, as Qwen3) and OLMo 2's placement of the layer norms, after attention and
after the MLP (the layer's own forward applies them), in Llama's numerics. Its hybrid layout
(``sliding_window`` set): sliding layers from ``layer_types`` with RoPE, and full layers that
apply no rotary at all ("global NoPE": ``no_rotary``); with ``sliding_window=None`` every layer is
global and rotates."""

from .attention import PER_HEAD, AttentionPolicy, no_rotary
from .base import DecoderPolicy, register_policy
from .modules import ModuleNames


def _sliding_layer_window(config, attention):
    return attention.sliding_window if attention.is_sliding else None


def _parts(config, attention, parts):
    """The full layers of a hybrid model (``sliding_window`` set) apply no rotary."""
    rotary = attention.sliding_window is None or attention.is_sliding
    return parts if rotary else no_rotary(parts)


POLICY = register_policy(DecoderPolicy(
    name="exaone4", model_types=("exaone4",), class_names=("Exaone4ForCausalLM",),
    modules=ModuleNames(layer_norms=("post_attention_layernorm", "post_feedforward_layernorm")),
    attn=AttentionPolicy(qk_norm=PER_HEAD, sliding_window=_sliding_layer_window,
                         family_parts=_parts)))

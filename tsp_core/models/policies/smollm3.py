"""SmolLM3 (SmolLM3ForCausalLM): Llama's layout with NoPE layers: ``config.no_rope_layers[i]`` 0
makes layer i apply no rotary at all (the attention's ``use_rope``; ``no_rotary``), and optional
sliding layers (``use_sliding_window`` with ``layer_types``: the attention's ``sliding_window``)."""

from .attention import AttentionPolicy, no_rotary, window_from_module
from .base import DecoderPolicy, register_policy


def _parts(config, attention, parts):
    """Layer i applies no rotary where ``no_rope_layers[i]`` is 0 (the attention's use_rope)."""
    return parts if attention.use_rope else no_rotary(parts)


POLICY = register_policy(DecoderPolicy(
    name="smollm3", model_types=("smollm3",), class_names=("SmolLM3ForCausalLM",),
    attn=AttentionPolicy(sliding_window=window_from_module, family_parts=_parts)))

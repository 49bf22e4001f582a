"""SmolLM3 (SmolLM3ForCausalLM): Llama's layout with NoPE layers: ``config.no_rope_layers[i]`` 0
makes layer i apply no rotary at all (the attention's ``use_rope``; ``rotary``), and optional
sliding layers (``use_sliding_window`` with ``layer_types``: the attention's ``sliding_window``)."""

from .base import DecoderPolicy, register_policy


def _window(config, attention):
    return getattr(attention, "sliding_window", None)


def _rotary(config, attention):
    return bool(attention.use_rope)


POLICY = register_policy(DecoderPolicy(
    name="smollm3", model_types=("smollm3",), class_names=("SmolLM3ForCausalLM",),
    sliding_window=_window, rotary=_rotary))

"""Qwen3.5 text (``qwen3_5_text``, Qwen3_5ForCausalLM). Its full-attention layers: Qwen3's
layout (per-head q/k norms before RoPE, explicit ``head_dim``) with an output gate (``q_proj``
gives per head [query | gate], 2 * head_dim rows; the attention output times sigmoid(gate) before
``o_proj``: ``output_gate``), partial rotary (``partial_rotary_factor``, 0.25 by default: the
model's rotary gives cos/sin of the rotated channels only), and every RMSNorm scaled by
``1 + weight`` in float32 at least (``norm="gemma"``). The text rotary's multimodal sections
(``mrope_section``) rotate by the same position on every axis for text: plain RoPE.

Refused by config value: ``layer_types`` entries "linear_attention" (the Gated DeltaNet layers)."""

from __future__ import annotations

from typing import Any

from .base import DecoderPolicy, register_policy


def _refused(config: Any) -> list[str]:
    """Gated DeltaNet layers ("linear_attention" in ``layer_types``): not run by TSP yet."""
    types = list(getattr(config, "layer_types", None) or [])
    linear = [i for i, t in enumerate(types) if t == "linear_attention"]
    if not linear:
        return []
    return [f"config.layer_types[{linear[0]}]='linear_attention' ({len(linear)} of "
            f"{len(types)} layers are Gated DeltaNet linear attention, layers {linear}; only "
            f"'full_attention' layers run under TSP for now: set layer_types to all "
            f"'full_attention' for a model without them)"]


POLICY = register_policy(DecoderPolicy(
    name="qwen3_5", model_types=("qwen3_5_text",), class_names=("Qwen3_5ForCausalLM",),
    norm="gemma", head_norms=("q_norm", "k_norm"), output_gate=True, refused=_refused))

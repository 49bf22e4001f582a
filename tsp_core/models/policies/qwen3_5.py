"""Qwen3.5 text (``qwen3_5_text``, Qwen3_5ForCausalLM). Its full-attention layers: Qwen3's
layout (per-head q/k norms before RoPE, explicit ``head_dim``) with an output gate (``q_proj``
gives per head [query | gate], 2 * head_dim rows; the attention output times sigmoid(gate) before
``o_proj``: ``output_gate``), partial rotary (``partial_rotary_factor``, 0.25 by default: the
model's rotary gives cos/sin of the rotated channels only), and every RMSNorm scaled by
``1 + weight`` in float32 at least (``norm="gemma"``). The text rotary's multimodal sections
(``mrope_section``) rotate by the same position on every axis for text: plain RoPE.

Its linear-attention layers (``layer_types`` "linear_attention", module ``linear_attn``): Gated
DeltaNet, run by TSPGatedDeltaNet (tsp_core.layers.linear_attention)."""

from __future__ import annotations

from .attention import PER_HEAD, AttentionPolicy
from .base import DecoderPolicy, register_policy
from .modules import ModuleNames

POLICY = register_policy(DecoderPolicy(
    name="qwen3_5", model_types=("qwen3_5_text",), class_names=("Qwen3_5ForCausalLM",),
    norm="gemma", attn=AttentionPolicy(qk_norm=PER_HEAD, output_gate=True),
    modules=ModuleNames(linear_attention="linear_attn")))

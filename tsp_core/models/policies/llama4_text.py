"""Llama 4 text (Llama4ForCausalLM, ``model_type`` "llama4_text"; the vision model is not a
causal LM TSP runs). Llama's layout with:

- RoPE on channel pairs from one complex ``freqs_cis`` (``Rotary("complex")``; the attention
  turns it into cos/sin: :func:`tsp_core.layers.attention.module.real_rotary`);
- NoPE layers (``no_rope_layers[i]`` 0: the attention's ``use_rope``), whose queries are scaled by
  the attention temperature of their global position when ``attn_temperature_tuning``:
  ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` (:class:`TemperatureTuning`);
- chunked local attention on the ``layer_types`` "chunked_attention" layers (the RoPE layers):
  a token sees only the keys of its own ``attention_chunk_size`` chunk;
- an L2 q/k norm without weight (``use_qk_norm``: ``qk_norm``, only on RoPE layers), after RoPE;
- dense layers of ``intermediate_size_mlp`` channels, interleaved with MoE layers
  (``moe_layers``): ``num_local_experts`` experts of ``intermediate_size``, top
  ``num_experts_per_tok`` router logits, the sigmoid of each weighting the expert's *input*, and
  a shared expert (``shared_expert``, ``intermediate_size``) on every token; the experts stored
  [E, h, 2F] (gate columns, then up) and [E, F, h], and so saved (the Hub's layout:
  ``hub_parts=None``); the block returns (output, router logits), as Hugging Face's does
  (``returns_pair``); no load-balancing loss.

Hugging Face computes the rotation, the L2 norm, the router's sigmoid and the temperature in
float32 whatever the model's dtype; TSP does the same in bf16 and float32 and keeps a float64
model in float64 (its tests compare against a float64-faithful copy of that code)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...layers.attention.parts import AttentionParts, QKNorm, Rotary
from .attention import AttentionPolicy, no_rotary
from .base import DecoderPolicy, register_policy
from .ffn import ExpertsPolicy, FeedForwardPolicy
from .modules import ModuleNames


@dataclass(frozen=True)
class TemperatureTuning:
    """Llama 4's attention temperature (arXiv 2501.19399) as a query scale of global positions
    (:attr:`tsp_core.layers.attention.AttentionParts.query_scale`): Hugging Face's own formula,
    computed in ``dtype`` (float32 for bf16 and float32 models, as Hugging Face does)."""

    floor_scale: float
    attn_scale: float

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        p = positions.to(dtype)
        return torch.log1p(torch.floor((p + 1.0) / self.floor_scale)) * self.attn_scale + 1.0


def _chunk(config, attention):
    if config.layer_types[attention.layer_idx] != "chunked_attention":
        return None
    return config.attention_chunk_size


def _temperature(config, attention):
    if not attention.attn_temperature_tuning or attention.use_rope:
        return None
    return TemperatureTuning(float(attention.floor_scale), float(attention.attn_scale))


def _l2_norm(config, attention) -> QKNorm | None:
    """The weightless L2 q/k norm, after RoPE (only on RoPE layers, when use_qk_norm)."""
    norm = getattr(attention, "qk_norm", None)
    return None if norm is None else QKNorm("l2", float(norm.eps), after_rope=True)


def _parts(config, attention, parts: AttentionParts) -> AttentionParts:
    """Llama 4's own parts: the chunk, the L2 q/k norm, and on NoPE layers no rotary and the
    attention temperature."""
    parts = replace(parts, mask=replace(parts.mask, chunk_size=_chunk(config, attention)),
                    qk_norm=_l2_norm(config, attention),
                    query_scale=_temperature(config, attention))
    return parts if attention.use_rope else no_rotary(parts)


def _no_renorm(config):
    return False


def _experts(config):
    return dict(router="topk_sigmoid", weight_input=True, layout="columns",
                shared_intermediate_size=config.intermediate_size, shared_name="shared_expert")


# dense layers of intermediate_size_mlp channels between the MoE layers
FFN = FeedForwardPolicy(
    dense_intermediate_size="intermediate_size_mlp",
    moe=ExpertsPolicy(num_experts="num_local_experts", router="router", norm_topk=_no_renorm,
                      options=_experts, aux_loss=False, returns_pair=True, hub_parts=None))


POLICY = register_policy(DecoderPolicy(
    name="llama4_text", model_types=("llama4_text",), class_names=("Llama4ForCausalLM",),
    modules=ModuleNames(mlp="feed_forward"), ffn=FFN,
    attn=AttentionPolicy(rotary=Rotary("complex"), family_parts=_parts)))

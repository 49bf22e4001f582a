"""Qwen3-Next (Qwen3NextForCausalLM, ``qwen3_next``): Qwen3.5's hybrid of Gated DeltaNet
(``layer_types`` "linear_attention", module ``linear_attn``) and full-attention layers (the
output gate, per-head q/k norms, partial rotary: ``output_gate``, ``PER_HEAD``), every RMSNorm
scaled by ``1 + weight`` (``norm="gemma"``), with two differences:

- the Gated DeltaNet's projections are fused per key head: ``in_proj_qkvz`` holds, key head by
  key head, [q | k | v | z] rows and ``in_proj_ba`` [b | a] (tsp_core/models/delta_net.py
  ``fuse_per_key_head``: a rank reads and writes its own key heads' groups, its TSP module keeps
  the parts apart as Qwen3.5's);
- its MLPs are Qwen3-MoE's sparse blocks (softmax router, top ``num_experts_per_tok`` of
  ``num_experts``, renormalised with ``norm_topk_prob``, cast back to the logits' dtype, the
  load-balancing loss) with one shared expert of ``shared_expert_intermediate_size`` channels
  on every token, scaled per token by ``sigmoid(shared_expert_gate(x))`` (a replicated [1, h]
  weight). Layers in ``mlp_only_layers`` or off ``decoder_sparse_step`` keep a dense MLP of
  ``intermediate_size``."""

from __future__ import annotations

from typing import Any

from .attention import PER_HEAD, AttentionPolicy
from .base import DecoderPolicy, register_policy
from .ffn import ExpertsPolicy, FeedForwardPolicy
from .modules import ModuleNames


def _norm_topk(config: Any) -> bool:
    return bool(config.norm_topk_prob)


def _shared_expert(config: Any) -> dict:
    """The shared expert and its gate; refused without channels (Hugging Face then keeps a
    shared MLP of 0 channels, which TSP cannot split)."""
    size = config.shared_expert_intermediate_size
    if not size:
        raise ValueError(f"config.shared_expert_intermediate_size={size!r}: Hugging Face's "
                         f"Qwen3-Next then keeps an empty shared_expert (0 channels) behind its "
                         f"shared_expert_gate, which TSP does not take; use a size >= 1 (every "
                         f"released Qwen3-Next has 512)")
    return dict(shared_intermediate_size=size, shared_name="shared_expert",
                shared_gate="shared_expert_gate")


POLICY = register_policy(DecoderPolicy(
    name="qwen3_next", model_types=("qwen3_next",), class_names=("Qwen3NextForCausalLM",),
    norm="gemma", attn=AttentionPolicy(qk_norm=PER_HEAD, output_gate=True),
    modules=ModuleNames(linear_attention="linear_attn"),
    ffn=FeedForwardPolicy(moe=ExpertsPolicy(
        num_experts="num_experts", intermediate_size="moe_intermediate_size",
        norm_topk=_norm_topk, weights_in_logits_dtype=True, options=_shared_expert))))

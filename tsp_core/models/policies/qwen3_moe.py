"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k norms, sliding layers from
``config.layer_types``) with sparse mixture-of-experts MLPs of ``moe_intermediate_size`` per
expert, top ``num_experts_per_tok`` of ``num_experts``, weights renormalised when
``norm_topk_prob`` and cast back to the logits' dtype; the layers in ``mlp_only_layers`` (or off
the ``decoder_sparse_step``) keep a dense MLP of ``intermediate_size``."""

from .attention import PER_HEAD, AttentionPolicy, window_from_module
from .base import DecoderPolicy, register_policy
from .ffn import ExpertsPolicy, FeedForwardPolicy


def _norm_topk(config):
    return bool(config.norm_topk_prob)


POLICY = register_policy(DecoderPolicy(
    name="qwen3_moe", model_types=("qwen3_moe",), class_names=("Qwen3MoeForCausalLM",),
    attn=AttentionPolicy(sliding_window=window_from_module, qk_norm=PER_HEAD),
    ffn=FeedForwardPolicy(moe=ExpertsPolicy(
        num_experts="num_experts", intermediate_size="moe_intermediate_size",
        norm_topk=_norm_topk, weights_in_logits_dtype=True))))

"""Hunyuan dense (HunYuanDenseV1ForCausalLM): Llama's layout with per-head q/k RMSNorms
(``query_layernorm``, ``key_layernorm``) applied after RoPE, not before it
(``head_norms_after_rope``), and its NTK-alpha rotary (the model's own cos/sin)."""

from .base import DecoderPolicy, register_policy

POLICY = register_policy(DecoderPolicy(
    name="hunyuan_v1_dense", model_types=("hunyuan_v1_dense",),
    class_names=("HunYuanDenseV1ForCausalLM",), head_norms=("query_layernorm", "key_layernorm"),
    head_norms_after_rope=True))

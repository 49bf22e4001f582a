"""Hunyuan dense (HunYuanDenseV1ForCausalLM): Llama's layout with per-head q/k RMSNorms
(``query_layernorm``, ``key_layernorm``) applied after RoPE, not before it
(``QKNorm.after_rope``), and its NTK-alpha rotary (the model's own cos/sin)."""

from ...layers.attention.parts import QKNorm
from .attention import AttentionPolicy
from .base import DecoderPolicy, register_policy

POLICY = register_policy(DecoderPolicy(
    name="hunyuan_v1_dense", model_types=("hunyuan_v1_dense",),
    class_names=("HunYuanDenseV1ForCausalLM",),
    attn=AttentionPolicy(qk_norm=QKNorm(names=("query_layernorm", "key_layernorm"),
                                        after_rope=True))))

"""Apertus (ApertusForCausalLM): Llama's projections (q/k/v/o biases with ``attention_bias``) with
per-head q/k RMSNorms before RoPE (``q_norm``, ``k_norm``, as Qwen3), its layer norms named
``attention_layernorm`` and ``feedforward_layernorm``, and an ungated MLP ``down(xIELU(up(x)))``:
an MLP without a gate becomes :class:`~tsp_core.layers.mlp.TSPPlainMLP`, whose xIELU keeps
its learnable ``alpha_p``, ``alpha_n`` (replicated, gradients summed over the group) and its
``beta``, ``eps`` buffers under Hugging Face's names."""

from .attention import PER_HEAD, AttentionPolicy
from .base import DecoderPolicy, register_policy
from .modules import ModuleNames

POLICY = register_policy(DecoderPolicy(
    name="apertus", model_types=("apertus",), class_names=("ApertusForCausalLM",),
    modules=ModuleNames(layer_norms=("attention_layernorm", "feedforward_layernorm")),
    attn=AttentionPolicy(qk_norm=PER_HEAD)))

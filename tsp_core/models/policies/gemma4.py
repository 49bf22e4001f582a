"""Gemma 4 text (``gemma4_text``, Gemma4ForCausalLM). Gemma 3's layout (sandwich norms, sliding
layers from ``config.layer_types``, per-head q/k norms, a scaled word embedding, tanh-GELU, the
final logit soft-cap) with Gemma 4's numerics and features:

- every RMSNorm scales by its weight itself, not ``1 + weight`` (``norm="gemma4"``), and the
  attention's softmax scale is 1 (the module's ``scaling``);
- a value norm, an RMSNorm without a weight over each value head (``ValueNorm``, from the
  attention's ``v_norm``);
- the global (full-attention) layers have their own head size and, with ``attention_k_eq_v``,
  their own key/value heads and no value projection: the values are the key projection's output
  before the key norm and RoPE (``AttentionParts.values_from_keys``); read per layer from the
  attention module;
- per-layer inputs (``hidden_size_per_layer_input`` > 0): a second embedding,
  ``embed_tokens_per_layer``, vocabulary-sharded like the main one (``extra_embeds``), and small
  per-token projections and norms, replicated over the TSP group (``base_replicated``,
  ``layer_replicated``); the model's own code combines them, as in Hugging Face;
- KV-shared layers (``num_kv_shared_layers``): the last layers attend with the K/V of the last
  earlier layer of their type (``KVSharing``: that layer's schedule hands over this rank's
  tokens' K/V and takes their gradient back), with MLPs of their own width
  (``use_double_wide_mlp``, read per layer);
- the MoE block (``enable_moe_block``): every layer runs its dense MLP and a mixture of experts
  side by side, both on the layer's input (the MLP after ``pre_feedforward_layernorm``, the
  experts after ``pre_feedforward_layernorm_2``, routed by the un-normed input), each output
  normed (``post_feedforward_layernorm_1``, ``_2``) before their sum is. The layer's own code
  calls the ``router`` and the ``experts`` apart (``beside_mlp``): the router is a
  :class:`~tsp_core.layers.moe.TSPRouter` of kind "normed_softmax" (a weightless RMSNorm, the
  learned ``scale`` and h**-0.5, softmax top-k renormalised, times ``per_expert_scale``),
  replicated; the experts a :class:`~tsp_core.layers.moe.TSPMoE` under either MoE schedule,
  stored as Hugging Face stores them (``gate_up_proj`` [E, 2F, h], ``down_proj`` [E, h, F], on
  the Hub too); the three norms are replicated. Gemma 4 has no load-balancing loss.

Refused by config field (docs/families.md "Gemma 4"): ``use_bidirectional_attention``."""

from dataclasses import replace

from ...layers.attention.parts import AttentionParts, KVSharing, Values
from .attention import PER_HEAD, AttentionPolicy, value_norm_from_module, window_from_module
from .base import DecoderPolicy, register_policy
from .ffn import ExpertsPolicy, FeedForwardPolicy
from .gemma import SANDWICH, SOFTCAP_HEAD
from .modules import ModuleNames


def _values_from_keys(config, attention) -> bool:
    """attention_k_eq_v's global layers: Hugging Face builds them without a v_proj."""
    return hasattr(attention, "k_proj") and getattr(attention, "v_proj", None) is None


def _kv_sharing(config, attention) -> KVSharing | None:
    """Hugging Face's KV sharing of the layer (``config.kv_sharing_modes``), keyed by its type."""
    if getattr(attention, "is_kv_shared_layer", False):
        return KVSharing("reuse", attention.layer_type)
    if getattr(attention, "store_full_length_kv", False):
        return KVSharing("store", attention.layer_type)
    return None


def _parts(config, attention, parts: AttentionParts) -> AttentionParts:
    """Gemma 4's own parts: KV sharing, values from the keys, and the weightless value norm
    (``v_norm``, in Gemma 4's numerics), which a layer reusing another's K/V does not run."""
    sharing = _kv_sharing(config, attention)
    reuse = sharing is not None and sharing.reuses
    values = (Values() if reuse else
              value_norm_from_module(attention, "v_norm", "gemma4", "gemma4"))
    return replace(parts, kv_sharing=sharing, values_from_keys=_values_from_keys(config, attention),
                   values=values)


def _moe_options(config) -> dict:
    """The router's kind and the epsilon of its norm (Hugging Face's ``rms_norm_eps``)."""
    return {"router": "normed_softmax", "router_eps": config.rms_norm_eps}


# the per-layer inputs: their embedding, vocabulary-sharded like the main one, and their per-token
# projections and norms, replicated; in each layer too the MoE block's three norms, replicated
MODULES = ModuleNames(
    layer_norms=SANDWICH, extra_embeds=("embed_tokens_per_layer",),
    base_replicated=("per_layer_model_projection", "per_layer_projection_norm"),
    layer_replicated=("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm",
                      "pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                      "post_feedforward_layernorm_2"))

# the MoE block beside every dense MLP (enable_moe_block), its router called by the layer's code
EXPERTS = ExpertsPolicy(num_experts="num_experts", intermediate_size="moe_intermediate_size",
                        top_k="top_k_experts", router="router", hub_parts=None,
                        options=_moe_options, aux_loss=False, beside_mlp=True)


GEMMA4 = register_policy(DecoderPolicy(
    name="gemma4", model_types=("gemma4_text",), class_names=("Gemma4ForCausalLM",),
    norm="gemma4", modules=MODULES, ffn=FeedForwardPolicy(moe=EXPERTS), head=SOFTCAP_HEAD,
    attn=AttentionPolicy(sliding_window=window_from_module, qk_norm=PER_HEAD,
                         family_parts=_parts),
    unsupported=(("use_bidirectional_attention", "bidirectional attention"),)))

"""Phi-3 (Phi3ForCausalLM; Phi-3.5 and Phi-4-mini use it too): Llama's layout with two fused
projections, ``self_attn.qkv_proj`` (rows: every query head, then every key head, then every value
head) and ``mlp.gate_up_proj`` (rows: gate, then up; HF's ``chunk(2)`` takes gate first). The TSP
modules keep the parts (q/k/v, gate/up), sharded so that a rank owns whole heads and the matching
gate and up channels, and name them by the fused tensors in every full state dict and checkpoint.
Every layer uses ``config.sliding_window`` (None disables it); longrope and partial rotary are the
model's own rotary embedding. ``resid_pdrop`` (the layer's dropout modules on the attention's
and MLP's outputs) drops each rank's own tokens: the modules become RankDropoutModule.
Generation recomputes the KV cache where HF's Phi-3 ``generate`` does: once, when the sequence
first passes ``original_max_position_embeddings``."""

from .attention import AttentionPolicy, window_from_config
from .base import DecoderPolicy, register_policy
from .modules import ModuleNames

POLICY = register_policy(DecoderPolicy(
    name="phi3", model_types=("phi3",), class_names=("Phi3ForCausalLM",),
    attn=AttentionPolicy(sliding_window=window_from_config),
    modules=ModuleNames(fused=(("attention", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                               ("mlp", "gate_up_proj", ("gate_proj", "up_proj"))),
                        layer_dropouts=("resid_attn_dropout", "resid_mlp_dropout")),
    recompute_cache_at=lambda config: getattr(config, "original_max_position_embeddings", None)))

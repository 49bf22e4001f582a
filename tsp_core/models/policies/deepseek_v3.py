"""DeepSeek-V3 (DeepseekV3ForCausalLM, ``deepseek_v3``): multi-head latent attention (MLA) on its
own TSP schedule (:mod:`tsp_core.layers.attention.latent`: the latent ``[c_kv | k_rope]`` gathered
once per layer, each round broadcasting a head group's ``[q_b | kv_b | o]``), with or without
the low-rank query (``q_lora_rank``), DeepSeek's interleaved rotary pairs (``rope_interleave``)
and the softmax scale with yarn's mscale (the module's ``scaling``); the first
``first_k_dense_replace`` layers dense, the rest sparse with GLM-4.5's router (sigmoid scores,
the ``e_score_correction_bias`` buffer moving the choice, ``n_group`` groups of which the
``topk_group`` best hold the top ``num_experts_per_tok``, renormalised with ``norm_topk_prob``,
times ``routed_scaling_factor``) and ``n_shared_experts`` shared experts: the glm4_moe policy's
experts (:mod:`tsp_core.layers.moe`).

Generation decodes over a sequence-sharded latent cache (tsp_core/inference/latent_decode.py).
The next-token-prediction layers (``num_nextn_predict_layers``)
are not part of Hugging Face's model and are not trained here either."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...layers.attention.latent import TSPLatentAttention
from .attention import AttentionPolicy
from .base import DecoderPolicy, register_policy
from .ffn import FeedForwardPolicy
from .glm4_moe import EXPERTS as GLM4_MOE_EXPERTS


class HFTSPLatentAttention(TSPLatentAttention):
    """:class:`TSPLatentAttention` with the call signature of Hugging Face's attention module."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                cache=None, **kwargs: Any):
        if cache is not None:
            raise NotImplementedError("TSP latent attention's forward takes no KV cache")
        state = self.tsp_decode  # tsp_core.inference: a decode step, or prefill's latent sink
        if state is not None and state.decoding:
            return state.attention(self, hidden_states, position_embeddings), None
        return super().forward(hidden_states, position_embeddings, docs=kwargs.get("tsp_docs"),
                               kv_sink=None if state is None else state.sink), None


def latent_attention(mesh, config: Any, attn: nn.Module, opts: dict) -> HFTSPLatentAttention:
    """The TSP module of one ``DeepseekV3Attention``, its sizes and epsilons read from it."""
    q_norm = getattr(attn, "q_a_layernorm", None)
    return HFTSPLatentAttention(
        mesh, config.hidden_size, attn.num_heads, q_lora_rank=attn.q_lora_rank,
        kv_lora_rank=attn.kv_lora_rank, qk_nope_head_dim=attn.qk_nope_head_dim,
        qk_rope_head_dim=attn.qk_rope_head_dim, v_head_dim=attn.v_head_dim, scale=attn.scaling,
        rope_interleaved=bool(config.rope_interleave),
        attention_bias=attn.kv_a_proj_with_mqa.bias is not None,
        q_norm_eps=1e-6 if q_norm is None else q_norm.variance_epsilon,
        kv_norm_eps=attn.kv_a_layernorm.variance_epsilon, init_seed=None, **opts)


POLICY = register_policy(DecoderPolicy(
    name="deepseek_v3", model_types=("deepseek_v3",), class_names=("DeepseekV3ForCausalLM",),
    attn=AttentionPolicy(module=latent_attention),
    ffn=FeedForwardPolicy(moe=GLM4_MOE_EXPERTS)))

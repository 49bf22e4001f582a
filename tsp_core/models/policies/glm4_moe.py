"""GLM-4.5 (Glm4MoeForCausalLM): Llama's layout with optional per-head q/k norms
(``use_qk_norm``), partial rotary on rotate-half channels (``partial_rotary_factor``; not GLM-4
dense's interleaved pairs), the first ``first_k_dense_replace`` layers dense and the rest sparse:
``n_routed_experts`` experts of ``moe_intermediate_size``, top ``num_experts_per_tok`` by the
sigmoid router (the ``e_score_correction_bias`` buffer moves the choice, ``n_group`` groups of
which the ``topk_group`` best hold the choice, weights renormalised when ``norm_topk_prob``,
times ``routed_scaling_factor``) plus ``n_shared_experts`` shared experts, one dense gated MLP
of ``n_shared_experts * moe_intermediate_size`` on every token. No load-balancing loss (the
correction bias balances). The router weight and the correction bias stay float32 in a bf16
model, as ``from_pretrained`` keeps them (``router_float32``)."""

from .attention import PER_HEAD, AttentionPolicy
from .base import DecoderPolicy, register_policy
from .ffn import ExpertsPolicy, FeedForwardPolicy


def _norm_topk(config):
    return bool(config.norm_topk_prob)


def _qk_norm(config):
    return bool(config.use_qk_norm)


def _router(config):
    if not config.n_shared_experts:  # Hugging Face then keeps a shared MLP of 0 channels
        raise ValueError(f"config.n_shared_experts={config.n_shared_experts!r}: Hugging Face's "
                         f"GLM-4.5 then keeps empty shared_experts weights (0 channels), which "
                         f"TSP does not take; use n_shared_experts >= 1 (every released GLM-4.5 "
                         f"has 1)")
    return dict(router="sigmoid", routed_scaling=float(config.routed_scaling_factor),
                n_group=config.n_group, topk_group=config.topk_group, correction_bias=True,
                shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts)


# the sigmoid router with its correction bias and groups, and the shared experts; DeepSeek-V3's
# experts are the same (policies/deepseek_v3.py)
EXPERTS = ExpertsPolicy(num_experts="n_routed_experts", intermediate_size="moe_intermediate_size",
                        norm_topk=_norm_topk, options=_router, aux_loss=False,
                        router_float32=True)


POLICY = register_policy(DecoderPolicy(
    name="glm4_moe", model_types=("glm4_moe",), class_names=("Glm4MoeForCausalLM",),
    attn=AttentionPolicy(qk_norm=PER_HEAD, qk_norm_on=_qk_norm),
    ffn=FeedForwardPolicy(moe=EXPERTS)))

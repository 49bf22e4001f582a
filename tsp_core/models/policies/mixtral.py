"""Mixtral (MixtralForCausalLM): Mistral's layout (every layer uses ``config.sliding_window``) with
a sparse mixture-of-experts block as every MLP: ``num_local_experts`` experts, top
``num_experts_per_tok``, weights always renormalised (float32). The router's input jitter
(``router_jitter_noise``) is random and is refused. Hub checkpoints keep each expert's
``w1`` (gate), ``w3`` (up), ``w2`` (down) under ``block_sparse_moe``."""

from .attention import AttentionPolicy, window_from_config
from .base import DecoderPolicy, register_policy
from .ffn import ExpertsPolicy, FeedForwardPolicy

POLICY = register_policy(DecoderPolicy(
    name="mixtral", model_types=("mixtral",), class_names=("MixtralForCausalLM",),
    attn=AttentionPolicy(sliding_window=window_from_config),
    ffn=FeedForwardPolicy(moe=ExpertsPolicy(num_experts="num_local_experts",
                                            hub_parts=("w1", "w3", "w2"),
                                            hub_module="block_sparse_moe")),
    unsupported=(("router_jitter_noise", "random jitter of the router's input in training"),)))

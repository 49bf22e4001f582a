"""Mixtral (MixtralForCausalLM): Mistral's layout (every layer uses ``config.sliding_window``) with
a sparse mixture-of-experts block as every MLP: ``num_local_experts`` experts, top
``num_experts_per_tok``, weights always renormalised (float32). The router's input jitter
(``router_jitter_noise``) is random and is refused. Hub checkpoints keep each expert's
``w1`` (gate), ``w3`` (up), ``w2`` (down) under ``block_sparse_moe``."""

from .base import DecoderPolicy, ExpertsPolicy, register_policy


def _window(config, attention):
    return getattr(config, "sliding_window", None)


POLICY = register_policy(DecoderPolicy(
    name="mixtral", model_types=("mixtral",), class_names=("MixtralForCausalLM",),
    sliding_window=_window,
    moe=ExpertsPolicy(num_experts="num_local_experts", hub_parts=("w1", "w3", "w2"),
                      hub_module="block_sparse_moe"),
    unsupported=(("router_jitter_noise", "random jitter of the router's input in training"),)))

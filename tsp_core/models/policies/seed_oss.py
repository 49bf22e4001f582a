"""Seed-OSS (SeedOssForCausalLM): Llama's layout with q/k/v biases (``attention_bias``), an
o_proj bias of its own (``attention_out_bias``) and an explicit ``head_dim``. Its
``residual_dropout`` (dropout on the attention's and the MLP's outputs, 0.1 in the config's
defaults) is the policy's ``output_dropout``: applied on each rank's own tokens."""

from .base import DecoderPolicy, register_policy

POLICY = register_policy(DecoderPolicy(
    name="seed_oss", model_types=("seed_oss",), class_names=("SeedOssForCausalLM",),
    output_dropout="residual_dropout"))

"""Seed-OSS (SeedOssForCausalLM): Llama's layout with q/k/v biases (``attention_bias``), an
o_proj bias of its own (``attention_out_bias``) and an explicit ``head_dim``. Its
``residual_dropout`` (dropout on the attention's output, 0.1 in the config's defaults) is not
applied by TSP attention, so a non-zero value is refused rather than silently dropped."""

from .base import DecoderPolicy, register_policy

POLICY = register_policy(DecoderPolicy(
    name="seed_oss", model_types=("seed_oss",), class_names=("SeedOssForCausalLM",),
    unsupported=(("residual_dropout", "dropout on the attention output"),)))

"""Policies: where a Hugging Face decoder-only causal LM keeps each TSP role, one small file per
family. A policy is found by the model's class name or ``config.model_type``; register your own
with :func:`register_policy`."""

from . import (  # noqa: F401  (each registers its family)
    apertus,
    deepseek_v3,
    ernie4_5,
    exaone4,
    gemma,
    gemma4,
    glm4,
    glm4_moe,
    gpt_oss,
    granite,
    hunyuan_v1_dense,
    llama,
    llama4_text,
    mistral,
    mixtral,
    olmo2,
    olmo3,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    seed_oss,
    smollm3,
)
from .attention import AttentionPolicy
from .base import DecoderPolicy, find_policy, register_policy, supported
from .ffn import ExpertsPolicy, FeedForwardPolicy
from .head import HeadPolicy
from .modules import ModuleNames

__all__ = ["AttentionPolicy", "DecoderPolicy", "ExpertsPolicy", "FeedForwardPolicy", "HeadPolicy",
           "ModuleNames", "find_policy", "register_policy", "supported"]

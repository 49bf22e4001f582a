"""OLMo 3 (Olmo3ForCausalLM): OLMo 2's numerics and layout (q/k norms over all heads of a token,
norms after attention and after the MLP, ``norm="olmo2"``) plus sliding-window layers from
``config.layer_types`` (the attention's own ``sliding_window``, None on full layers)."""

from dataclasses import replace

from .attention import window_from_module
from .base import DecoderPolicy, register_policy
from .olmo2 import POLICY as OLMO2

POLICY = register_policy(DecoderPolicy(
    name="olmo3", model_types=("olmo3",), class_names=("Olmo3ForCausalLM",), norm=OLMO2.norm,
    modules=OLMO2.modules, attn=replace(OLMO2.attn, sliding_window=window_from_module)))

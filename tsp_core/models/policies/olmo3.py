"""OLMo 3 (Olmo3ForCausalLM): OLMo 2's numerics and layout (q/k norms over all heads of a token,
norms after attention and after the MLP, ``norm="olmo2"``) plus sliding-window layers from
``config.layer_types`` (the attention's own ``sliding_window``, None on full layers)."""

from .base import DecoderPolicy, register_policy
from .olmo2 import POLICY as OLMO2


def _window(config, attention):
    return getattr(attention, "sliding_window", None)


POLICY = register_policy(DecoderPolicy(
    name="olmo3", model_types=("olmo3",), class_names=("Olmo3ForCausalLM",), norm=OLMO2.norm,
    layer_norms=OLMO2.layer_norms, head_norms=OLMO2.head_norms, qk_norm_all_heads=True,
    sliding_window=_window))

"""gpt-oss (GptOssForCausalLM): Llama's layout with biases on every attention projection,
attention sinks (each attention's ``sinks`` [heads]: one more softmax column without a value,
found by name), rotary cos/sin with each frequency once (``Rotary("half_width")``),
sliding-window and full layers alternating (``layer_types``: the attention's own
``sliding_window``), OLMo 2's RMSNorm numerics (scaled in float32, then cast), and sparse
MLPs on every layer: the router ``router`` (weight and bias) takes the top ``num_experts_per_tok``
logits and a softmax over them; ``num_local_experts`` experts stored as ``gate_up_proj`` [E, h, 2F]
with gate and up in alternate columns, ``down_proj`` [E, F, h], each with a bias, and the clamped
SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, g = min(gate, l) (``swiglu_limit``,
``swiglu_alpha``). The Hub stores the experts as the model does (no per-expert layout)."""

from ...layers.attention.parts import Rotary
from .attention import AttentionPolicy, window_from_module
from .base import DecoderPolicy, register_policy
from .ffn import ExpertsPolicy, FeedForwardPolicy
from .olmo2 import POLICY as OLMO2


def _experts(config):
    return dict(router="topk_softmax", router_bias=True, layout="interleaved", expert_bias=True,
                activation="swiglu_clamped", swiglu_limit=float(config.swiglu_limit),
                swiglu_alpha=float(config.swiglu_alpha))


POLICY = register_policy(DecoderPolicy(
    name="gpt_oss", model_types=("gpt_oss",), class_names=("GptOssForCausalLM",),
    norm=OLMO2.norm,
    attn=AttentionPolicy(sliding_window=window_from_module, rotary=Rotary("half_width")),
    ffn=FeedForwardPolicy(moe=ExpertsPolicy(num_experts="num_local_experts", router="router",
                                            options=_experts, hub_parts=None,
                                            returns_pair=True))))

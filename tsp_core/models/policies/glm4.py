"""GLM-4 dense (Glm4ForCausalLM): q/k/v biases, Phi-3's fused ``gate_up_proj``, four norms per
layer (before and after attention, before and after the MLP: the layer's own forward applies
them) and interleaved partial rotary (``partial_rotary_factor``, on channel pairs (2i, 2i+1):
``Rotary("interleaved")``)."""

from ...layers.attention.parts import Rotary
from .attention import AttentionPolicy
from .base import DecoderPolicy, register_policy
from .modules import ModuleNames

POLICY = register_policy(DecoderPolicy(
    name="glm4", model_types=("glm4",), class_names=("Glm4ForCausalLM",),
    modules=ModuleNames(
        layer_norms=("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
                     "post_mlp_layernorm"),
        fused=(("mlp", "gate_up_proj", ("gate_proj", "up_proj")),)),
    attn=AttentionPolicy(rotary=Rotary("interleaved"))))

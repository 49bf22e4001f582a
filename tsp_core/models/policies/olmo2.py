"""OLMo 2 (Olmo2ForCausalLM): Llama's projections with RMSNorms of q and k over the whole
projection width (all heads of a token: ``QKNorm(scope="token")``, run by the phased schedule of
:mod:`tsp_core.layers.attention.phased`), norms after attention and after the MLP instead of before
(the layer's own forward applies them), and its own RMSNorm numerics (scaled before the cast
back: ``norm="olmo2"``)."""

from ...layers.attention.parts import QKNorm
from .attention import AttentionPolicy
from .base import DecoderPolicy, register_policy
from .modules import ModuleNames

POLICY = register_policy(DecoderPolicy(
    name="olmo2", model_types=("olmo2",), class_names=("Olmo2ForCausalLM",), norm="olmo2",
    modules=ModuleNames(layer_norms=("post_attention_layernorm", "post_feedforward_layernorm")),
    attn=AttentionPolicy(qk_norm=QKNorm(scope="token"))))

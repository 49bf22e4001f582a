"""Gemma 1, 2 and 3 (text). All: RMSNorm scaled by ``1 + weight`` (``norm="gemma"``), a scaled
word embedding (its ``embed_scale`` is carried over), tanh-GELU, ``head_dim`` of its own, often
one key/value head. Gemma 2 and 3 add norms after attention and around the MLP (the layer's own
forward applies them), ``query_pre_attn_scalar`` as the softmax scale (the module's ``scaling``)
and sliding layers from ``config.layer_types``; Gemma 3 adds per-head q/k norms and local/global
rotary bases (the model picks each layer's). Soft-capping (Gemma 2's defaults; Gemma 3's fields,
off by default, work the same way): ``attn_logit_softcapping`` caps the attention scores
(``AttentionPolicy.softcap``: the flash pieces' tiled soft-capping kernel),
``final_logit_softcapping`` the logits (``logits_softcap``: the LM head, its loss and
generation), each ``tanh(x / cap) * cap`` as Hugging Face computes it."""

from .attention import PER_HEAD, AttentionPolicy, window_from_module
from .base import DecoderPolicy, register_policy
from .head import HeadPolicy
from .modules import ModuleNames

SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm")


def _attn_softcap(config):
    return getattr(config, "attn_logit_softcapping", None)


def _logits_softcap(config):
    return getattr(config, "final_logit_softcapping", None)


# the final logit soft-cap of Gemma 2, 3 and 4 (config.final_logit_softcapping)
SOFTCAP_HEAD = HeadPolicy(logits_softcap=_logits_softcap)


GEMMA = register_policy(DecoderPolicy(name="gemma", model_types=("gemma",),
                                      class_names=("GemmaForCausalLM",), norm="gemma"))
GEMMA2 = register_policy(DecoderPolicy(name="gemma2", model_types=("gemma2",),
                                       class_names=("Gemma2ForCausalLM",), norm="gemma",
                                       modules=ModuleNames(layer_norms=SANDWICH),
                                       attn=AttentionPolicy(sliding_window=window_from_module,
                                                            softcap=_attn_softcap),
                                       head=SOFTCAP_HEAD))
GEMMA3 = register_policy(DecoderPolicy(
    name="gemma3", model_types=("gemma3_text",), class_names=("Gemma3ForCausalLM",), norm="gemma",
    modules=ModuleNames(layer_norms=SANDWICH),
    attn=AttentionPolicy(sliding_window=window_from_module, qk_norm=PER_HEAD,
                         softcap=_attn_softcap), head=SOFTCAP_HEAD,
    unsupported=(("use_bidirectional_attention", "bidirectional attention"),)))

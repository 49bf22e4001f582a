"""Ernie 4.5 dense (Ernie4_5ForCausalLM): Llama's layout with a bias on every projection when
``use_bias`` is set (q/k/v/o and gate/up/down: read from the modules), tied embeddings by default
and interleaved rotary (channel pairs (2i, 2i+1): ``Rotary("interleaved")``). Hugging Face's rotary
embedding returns float32 cos/sin and rotates q and k in float32 whatever the model's dtype
(``q.float() * cos``), rounding only the result: TSP rotates in the wider of the activations'
dtype and the cos/sin's (``tsp_core.layers.rope.rotation_inputs``), so in bfloat16 and float32
it gives Hugging Face's numbers bit for bit; in float64 TSP keeps float64 (HF rounds q and k to
float32 there)."""

from ...layers.attention.parts import Rotary
from .attention import AttentionPolicy
from .base import DecoderPolicy, register_policy

POLICY = register_policy(DecoderPolicy(
    name="ernie4_5", model_types=("ernie4_5",), class_names=("Ernie4_5ForCausalLM",),
    attn=AttentionPolicy(rotary=Rotary("interleaved"))))

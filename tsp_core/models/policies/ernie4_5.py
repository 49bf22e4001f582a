"""Ernie 4.5 dense (Ernie4_5ForCausalLM): Llama's layout with a bias on every projection when
``use_bias`` is set (q/k/v/o and gate/up/down: read from the modules), tied embeddings by default
and interleaved rotary (channel pairs (2i, 2i+1): ``rope_interleaved``). Hugging Face rotates q
and k in float32 whatever the model's dtype (``q.float() * cos``); TSP rotates them in the
model's dtype with the same float32 cos/sin: the same numbers in float32; in float64 TSP keeps
float64 (HF rounds q and k to float32 there); in bfloat16 TSP rounds cos/sin and the products
to bfloat16 where Hugging Face rounds only the result."""

from .base import DecoderPolicy, register_policy

POLICY = register_policy(DecoderPolicy(
    name="ernie4_5", model_types=("ernie4_5",), class_names=("Ernie4_5ForCausalLM",),
    rope_interleaved=True))

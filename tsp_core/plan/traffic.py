"""Bytes each rank sends per decoder layer in the forward pass, by layout (DESIGN 5), in the same
ring accounting as :mod:`tsp_core.comm` (so measured and predicted numbers are comparable).

With h = hidden size, g = query heads per key/value head (h over the K/V width when head_dim is
not h / heads), F = MLP intermediate size, W_att = (2 + 2/g) h^2 (2 h (q + k/v widths) in
general) and W_mlp = 3 F h (elements), on a T x C mesh (T tensor-parallel ranks
inside C context-parallel ones; TSP uses D = T):

- tp, tp-sp:  4 (T-1)/T * B (S/C) h          two all-reduces, or two all-gather + reduce-scatter
- cp:         2 (C-1)/C * B S (h/T) / g      all-gather of K and V (this rank's heads)
- tsp:        (D-1)/D * (W_att + W_mlp + 2 B S h / g)   weights + K/V
              (also when nkv < D: the key/value rows are sliced 1/D per rank and
              all-gathered once, each head's K/V gathered once)

so TSP moves less than tp / tp-sp once B S (4 - 2/g) h > W_att + W_mlp (B*S > 8h for g=1, F=4h).
Backward is about twice the forward for every layout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder layer that decide its traffic and memory."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    num_layers: int = 1
    vocab_size: int = 32000
    head_dim: int | None = None   # None: hidden_size / num_heads

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        nq = config.num_attention_heads
        return cls(config.hidden_size, nq, getattr(config, "num_key_value_heads", None) or nq,
                   config.intermediate_size, config.num_hidden_layers, config.vocab_size,
                   getattr(config, "head_dim", None))

    @property
    def q_width(self) -> int:
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def kv_width(self) -> int:
        """One of K, V per token: num_kv_heads * head_dim."""
        return self.num_kv_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def group(self) -> float:
        """g = h / kv_width, so that h / g is one of K, V per token: query heads per key/value
        head when num_heads * head_dim = h (Llama, Qwen2); Gemma's head_dim is its own."""
        return self.hidden_size / self.kv_width

    @property
    def attention_weights(self) -> float:
        """q, k, v, o projections: 2 h (q_width + kv_width); (2 + 2/g) h^2 when q_width = h."""
        return 2 * self.hidden_size * (self.q_width + self.kv_width)

    @property
    def mlp_weights(self) -> float:
        return 3 * self.intermediate_size * self.hidden_size


def layer_forward_elements(name: str, tp: int, cp: int, shape: ModelShape, batch: int,
                           seq: int) -> float:
    """Elements one rank sends in one decoder layer's forward (``name`` as in
    :data:`tsp_core.baselines.LAYOUTS`; TSP's degree is ``tp``)."""
    h, g = shape.hidden_size, shape.group
    if name == "tsp":
        d = tp
        return (d - 1) / d * (shape.attention_weights + shape.mlp_weights + 2 * batch * seq * h / g)
    tensor = 4 * (tp - 1) / tp * batch * (seq / cp) * h
    context = 2 * (cp - 1) / cp * batch * seq * (h / tp) / g
    return tensor + context


def crossover_tokens(shape: ModelShape) -> float:
    """B*S above which TSP's forward moves fewer bytes than tp / tp-sp at the same degree (both
    carry the same (D-1)/D factor)."""
    h, g = shape.hidden_size, shape.group
    return (shape.attention_weights + shape.mlp_weights) / ((4 - 2 / g) * h)

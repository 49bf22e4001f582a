"""What the attention backward of the default schedule holds at its peak beyond the weight shard
buffers (docs/memory.md "The attention backward's floor"): one head group's whole-sequence terms
and the local terms of this rank's own tokens. ``tests/layers/test_attention_floor.py`` holds
the measured backward to it at S and 4S."""

from __future__ import annotations


def backward_floor_bytes(seq: int, tsp_size: int, head_dim: int, kv_heads: int, q_heads: int,
                         hidden: int, *, batch: int = 1, dtype_bytes: int = 2,
                         acc_bytes: int = 4, layout: str = "zigzag") -> int:
    """Bytes the backward of one TSP attention layer (per-group schedule) adds at its peak,
    besides its weight shard and weight-gradient buffers (which do not depend on the sequence).

    ``seq``: the whole sequence S; ``kv_heads``: key/value heads of one head group
    (``AttentionSpec.local_kv_heads``); ``q_heads``: query heads per rank
    (``AttentionSpec.local_heads``); ``dtype_bytes``: the activations' element size;
    ``acc_bytes``: the dK/dV and dQ accumulators' (float32; float64 for float64 input).

    - whole sequence, one head group: its gathered K/V in use, one more K/V-sized buffer (the
      next group's K/V arriving, or, in the first half of a round, the previous group's dK/dV
      leaving for the token owners: never both), and its dK/dV accumulator:
      ``2 B S kv d (2 e + a)``;
    - own tokens (L = S/D): dX, the round's dQ accumulator and dO, the previous group's dK/dV of
      these tokens: ``B L (h e + q d (a + e) + 2 kv d e)``;
    - one kernel call over one piece of t queries (a zigzag chunk, t = L/2; L for the contiguous
      layout) and at most t keys: its dO and output slices, its dQ, dK, dV and LSE slice:
      ``B t (3 q d e + q a + 2 kv d e)``.
    """
    if seq % tsp_size:
        raise ValueError(f"tsp_size ({tsp_size}) must divide the sequence ({seq})")
    local = seq // tsp_size
    e, a = dtype_bytes, acc_bytes
    whole = whole_sequence_bytes(seq, head_dim, kv_heads, batch=batch, dtype_bytes=e,
                                 acc_bytes=a)
    q, kv = q_heads * head_dim, kv_heads * head_dim
    own = batch * local * (hidden * e + q * (a + e) + 2 * kv * e)
    piece = local // 2 if layout == "zigzag" else local
    kernel = batch * piece * (3 * q * e + q_heads * a + 2 * kv * e)
    return whole + own + kernel


def whole_sequence_bytes(seq: int, head_dim: int, kv_heads: int, *, batch: int = 1,
                         dtype_bytes: int = 2, acc_bytes: int = 4) -> int:
    """The part of :func:`backward_floor_bytes` that grows with the whole sequence, not with a
    rank's tokens: one head group's K/V, one more K/V-sized buffer and the dK/dV accumulator."""
    return 2 * batch * seq * kv_heads * head_dim * (2 * dtype_bytes + acc_bytes)
